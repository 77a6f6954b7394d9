"""Corpus reading, tokenizers and token shards."""
