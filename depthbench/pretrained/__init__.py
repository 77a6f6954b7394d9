"""Pretrained Hugging Face models as runs: their adapter, loading, and the workflow stages."""
