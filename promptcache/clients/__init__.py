"""promptcache.clients."""
