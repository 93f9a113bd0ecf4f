"""A shared tier on local disk: one file per block (same format as Redis), LRU by access time."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from promptcache.cache_store.block import KVBlock
from promptcache.cache_store.errors import CacheStoreError
from promptcache.cache_store.redis_guard import logger
from promptcache.cache_store.serialization import dumps, loads
from promptcache.cache_store.tier import Tier


class DiskTier(Tier):
    """Blocks as files under `directory`; survives restarts; shared by processes on one host."""

    is_shared = True

    def __init__(self, directory: str | Path, *, max_bytes: int, name: str = "disk") -> None:
        self.name = name
        self.max_bytes = max_bytes
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def _path(self, key: str) -> Path:
        if not key.isalnum():
            raise CacheStoreError(f"disk tier keys must be alphanumeric, got {key!r}")
        return self.directory / f"{key}.kv"

    def get(self, key: str) -> KVBlock | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
            os.utime(path)  # LRU by access time
        except OSError:
            return None
        try:
            return loads(data, expect_key=key)
        except CacheStoreError as exc:
            logger.warning("dropping corrupted KV file %s: %s", path.name, exc)
            path.unlink(missing_ok=True)
            return None

    def put(self, key: str, block: KVBlock, *, pinned: bool = False,
            ttl_s: float | None = None) -> list[tuple[str, KVBlock]]:
        blob = dumps(block, key)
        if len(blob) > self.max_bytes:
            return []
        with self._lock:
            tmp = self._path(key).with_suffix(".tmp")
            tmp.write_bytes(blob)
            os.replace(tmp, self._path(key))
            files = sorted(self.directory.glob("*.kv"), key=lambda p: p.stat().st_mtime)
            used = sum(p.stat().st_size for p in files)
            for victim in files:
                if used <= self.max_bytes:
                    break
                if victim.stem != key:
                    used -= victim.stat().st_size
                    victim.unlink(missing_ok=True)
        return []

    def contains(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> bool:
        path = self._path(key)
        existed = path.is_file()
        path.unlink(missing_ok=True)
        return existed

    def pin(self, key: str) -> bool:
        return False  # disk entries are not pinned: the disk tier is the last resort

    def unpin(self, key: str) -> bool:
        return False

    @property
    def used_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.directory.glob("*.kv"))

    def keys(self) -> list[str]:
        return [p.stem for p in self.directory.glob("*.kv")]
