"""tokstream: a paged-KV, continuously batched LLM serving toolkit."""

__version__ = "0.1.0"
