"""DepthBench in the Hugging Face ecosystem: export runs as transformers models (export.py) and
cross-check the NLL stage with lm-evaluation-harness (lmeval.py)."""
