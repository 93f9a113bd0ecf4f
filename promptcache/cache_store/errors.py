"""The cache store's error tree, and the logger its tolerated failures (a miss, a dropped write) go to."""

from __future__ import annotations

import logging

logger = logging.getLogger("promptcache.cache_store")


class CacheStoreError(Exception):
    """Root of every cache-store error."""


class CorruptBlockError(CacheStoreError):
    """A serialized KV block failed its integrity checks (magic, version, length, checksum)."""


class BlockMismatchError(CacheStoreError):
    """A KV block is malformed, or stored under a key other than the one asked for."""


class CapacityError(CacheStoreError):
    """A block cannot fit in a tier: everything left there is pinned, or it exceeds the budget."""


class SchemaExistsError(CacheStoreError):
    """A schema of that name is already registered."""


class RegistryUnavailableError(CacheStoreError):
    """The shared schema registry (Redis) cannot be reached."""
