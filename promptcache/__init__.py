"""promptcache: LLM serving with prompt-module KV caching."""

__version__ = "0.1.0"
