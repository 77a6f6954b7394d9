"""Files copied into non-Llama exports (loaded by transformers with trust_remote_code=True)."""
