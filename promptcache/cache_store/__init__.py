"""Tiered KV store: device -> host -> Redis (and/or disk); keys, budgets, eviction, serialization.
Knows nothing about HTTP or requests; may hold tensors but never imports transformers."""

from promptcache.cache_store.block import KVBlock, chain_root, make_kv_key, owned_salt
from promptcache.cache_store.block_format import dumps, loads
from promptcache.cache_store.block_index import BlockIndex, BlockIndexConfig, Link, Match
from promptcache.cache_store.config import StoreConfig, build_store
from promptcache.cache_store.disk_tier import DiskTier
from promptcache.cache_store.errors import (
    BlockMismatchError,
    CacheStoreError,
    CapacityError,
    CorruptBlockError,
    RegistryUnavailableError,
    SchemaExistsError,
)
from promptcache.cache_store.fetch_policy import FetchPolicy
from promptcache.cache_store.layer_reach import LayerReach, window_reach
from promptcache.cache_store.memory_tier import MemoryTier
from promptcache.cache_store.redis_tier import RedisTier
from promptcache.cache_store.schema_registry import RegistryState, SchemaRegistry, StoredSchema
from promptcache.cache_store.signing import BlobSigner
from promptcache.cache_store.store import StoreStats, TieredStore, TierStats
from promptcache.cache_store.tier import BlockKind, Eviction, OwnerShares, Tier, TierHit, TierUsage

__all__ = ["BlobSigner", "BlockIndex", "BlockIndexConfig", "BlockKind", "BlockMismatchError", "CacheStoreError",
           "CapacityError", "CorruptBlockError", "DiskTier", "Eviction", "FetchPolicy", "LayerReach", "OwnerShares",
           "KVBlock",
           "Link", "Match", "MemoryTier", "RedisTier", "RegistryUnavailableError", "RegistryState", "SchemaExistsError",
           "SchemaRegistry", "StoreConfig", "StoreStats", "StoredSchema", "Tier", "TierHit", "TierStats", "TierUsage",
           "TieredStore", "build_store", "chain_root", "dumps", "loads", "make_kv_key", "owned_salt", "window_reach"]
