"""StoreConfig and build_store: the tiers a server's store is made of, and their budgets."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from promptcache.cache_store.disk_tier import DiskTier
from promptcache.cache_store.memory_tier import MemoryTier
from promptcache.cache_store.redis_tier import RedisTier
from promptcache.cache_store.signing import BlobSigner
from promptcache.cache_store.store import TieredStore
from promptcache.cache_store.tier import OwnerShares, Tier


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Budgets and backends: the device tier on the model's device, the host tier in CPU memory (pinned for a
    GPU), shared Redis and disk tiers. `device_max_bytes` None: DEFAULT_DEVICE_MAX_BYTES on a CPU, on a GPU
    DEVICE_FREE_FRACTION of the memory free when the store is built (after the model is loaded)."""

    device_max_bytes: int | None = None
    host_max_bytes: int = 4 << 30
    redis_url: str | None = None
    redis_max_bytes: int = 8 << 30
    redis_namespace: str = "default"
    redis_timeout_s: float = 0.5
    redis_retry_interval_s: float = 2.0
    disk_dir: str | None = None
    disk_max_bytes: int = 16 << 30
    write_through_shared: bool = True
    write_behind_max_bytes: int = 1 << 30  # queue for shared-tier writes; more is dropped (and counted)
    blob_key: bytes | None = None  # HMAC key: Redis blobs carry a tag checked on read (signing.py)
    owner_shares: tuple[tuple[str, float], ...] = ()  # (owner, fraction of each tier's budget): tier.OwnerShares

    def __post_init__(self) -> None:
        for name in ("device_max_bytes", "host_max_bytes", "redis_max_bytes", "disk_max_bytes",
                     "write_behind_max_bytes"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"StoreConfig.{name} must be > 0")
        if self.redis_timeout_s <= 0:
            raise ValueError("StoreConfig.redis_timeout_s must be > 0")


DEFAULT_DEVICE_MAX_BYTES = 1 << 30
DEVICE_FREE_FRACTION = 0.25  # of a GPU's free memory; the rest stays for the engine's own KV and activations


def device_budget(max_bytes: int | None, device: str) -> int:
    """The device tier's byte budget: `max_bytes` when set, else see StoreConfig."""
    if max_bytes is not None:
        return max_bytes
    if torch.device(device).type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(torch.device(device))
        return max(1, int(free_bytes * DEVICE_FREE_FRACTION))
    return DEFAULT_DEVICE_MAX_BYTES


def build_store(config: StoreConfig, device: str = "cpu") -> TieredStore:
    """device -> host -> [redis] -> [disk]."""
    shares = OwnerShares(dict(config.owner_shares))
    tiers: list[Tier] = [
        MemoryTier("device", device_budget(config.device_max_bytes, device), device, shares=shares),
        MemoryTier("host", config.host_max_bytes, "cpu", pin_memory=device != "cpu", shares=shares),
    ]
    if config.redis_url:
        tiers.append(RedisTier(config.redis_url, max_bytes=config.redis_max_bytes, namespace=config.redis_namespace,
                               timeout_s=config.redis_timeout_s, retry_interval_s=config.redis_retry_interval_s,
                               signer=BlobSigner(config.blob_key), shares=shares))
    if config.disk_dir:
        tiers.append(DiskTier(config.disk_dir, max_bytes=config.disk_max_bytes))
    return TieredStore(tiers, write_through_shared=config.write_through_shared,
                       write_behind_max_bytes=config.write_behind_max_bytes)
