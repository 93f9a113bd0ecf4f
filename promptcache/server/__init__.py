"""promptcache.server."""
