"""promptcache.cache_store."""
