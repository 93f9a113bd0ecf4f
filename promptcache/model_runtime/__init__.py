"""promptcache.model_runtime."""
