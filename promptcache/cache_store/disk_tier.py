"""A shared tier on local disk: one file per block (same format as Redis), LRU per kind by access time.

`<key>.kv` holds a "module" entry, `<key>.pkv` a "prefix" entry (so eviction can rank files by kind
from a directory listing alone). A file with a TTL starts with `PCEX` and its expiry (wall-clock
seconds, f64) before the blob; expired files are removed when read or evicted like any other.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from pathlib import Path

from promptcache.cache_store.block import KVBlock
from promptcache.cache_store.errors import CacheStoreError
from promptcache.cache_store.redis_guard import logger
from promptcache.cache_store.serialization import dumps, loads
from promptcache.cache_store.tier import BlockKind, Tier, TierHit, TierUsage

_SUFFIXES: dict[BlockKind, str] = {"module": ".kv", "prefix": ".pkv"}
_KINDS = {suffix: kind for kind, suffix in _SUFFIXES.items()}
_EXPIRY = struct.Struct("<4sd")
_EXPIRY_MAGIC = b"PCEX"


class DiskTier(Tier):
    """Blocks as files under `directory`; survives restarts; shared by processes on one host.

    Evicts "prefix" files (oldest access first) before "module" files. Disk entries are never pinned:
    the disk tier is the last resort.
    """

    is_shared = True

    def __init__(self, directory: str | Path, *, max_bytes: int, name: str = "disk") -> None:
        self.name = name
        self.max_bytes = max_bytes
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def _path(self, key: str, kind: BlockKind = "module") -> Path:
        if not key.isalnum():
            raise CacheStoreError(f"disk tier keys must be alphanumeric, got {key!r}")
        return self.directory / f"{key}{_SUFFIXES[kind]}"

    def get(self, key: str) -> KVBlock | None:
        hit = self.lookup(key)
        return None if hit is None else hit.block

    def lookup(self, key: str) -> TierHit | None:
        for kind in ("module", "prefix"):
            path = self._path(key, kind)
            try:
                data = path.read_bytes()
                _touch(path)
            except OSError:
                continue
            ttl_s = None
            if data[:4] == _EXPIRY_MAGIC:
                ttl_s = _EXPIRY.unpack_from(data)[1] - time.time()
                if ttl_s <= 0:
                    path.unlink(missing_ok=True)
                    return None
                data = memoryview(data)[_EXPIRY.size:]
            try:
                return TierHit(loads(data, expect_key=key), kind, ttl_s)
            except CacheStoreError as exc:
                logger.warning("dropping corrupted KV file %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
                return None
        return None

    def put(self, key: str, block: KVBlock, *, pinned: bool = False, ttl_s: float | None = None,
            kind: BlockKind = "module", owner: str | None = None) -> list[tuple[str, KVBlock]]:
        # The disk tier is operator-local spill space: no per-owner shares (docs/security.md).
        blob = dumps(block, key)
        if ttl_s is not None:
            blob = _EXPIRY.pack(_EXPIRY_MAGIC, time.time() + ttl_s) + blob
        if len(blob) > self.max_bytes:
            return []
        with self._lock:
            if kind == "prefix" and self._path(key, "module").is_file():
                kind = "module"  # a re-put never downgrades a module entry
            path = self._path(key, kind)
            tmp = self.directory / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"  # unique per writer
            tmp.write_bytes(blob)
            os.replace(tmp, path)
            _touch(path)
            if kind == "module":
                self._path(key, "prefix").unlink(missing_ok=True)
            self._evict(keep=path.name)
        return []

    def _evict(self, keep: str) -> None:
        """Delete the oldest prefix files, then the oldest module files, until the budget holds."""
        files = self._scan()
        used = sum(size for _, _, size, _ in files)
        for _, _, size, entry in sorted(files, key=lambda f: (f[0] != "prefix", f[1])):
            if used <= self.max_bytes:
                break
            if entry.name != keep:
                used -= size
                Path(entry.path).unlink(missing_ok=True)

    def _scan(self) -> list[tuple[BlockKind, int, int, os.DirEntry]]:
        """(kind, mtime_ns, size, entry) of every block file; files removed meanwhile are skipped."""
        found = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                kind = _KINDS.get(os.path.splitext(entry.name)[1])
                if kind is None or entry.name.startswith("."):
                    continue
                try:
                    stat = entry.stat()
                except OSError:
                    continue
                found.append((kind, stat.st_mtime_ns, stat.st_size, entry))
        return found

    def contains(self, key: str) -> bool:
        for kind in ("module", "prefix"):
            path = self._path(key, kind)
            try:
                with path.open("rb") as file:
                    head = file.read(_EXPIRY.size)
            except OSError:
                continue
            if head[:4] != _EXPIRY_MAGIC or len(head) < _EXPIRY.size:
                return True
            return _EXPIRY.unpack(head)[1] > time.time()
        return False

    def delete(self, key: str) -> bool:
        existed = False
        for kind in ("module", "prefix"):
            path = self._path(key, kind)
            existed = path.is_file() or existed
            path.unlink(missing_ok=True)
        return existed

    def pin(self, key: str) -> bool:
        return False  # disk entries are not pinned: the disk tier is the last resort

    def unpin(self, key: str) -> bool:
        return False

    @property
    def used_bytes(self) -> int:
        return sum(size for _, _, size, _ in self._scan())

    def keys(self) -> list[str]:
        return [entry.name.rsplit(".", 1)[0] for _, _, _, entry in self._scan()]

    def usage(self) -> TierUsage:
        files = self._scan()
        return TierUsage(sum(f[2] for f in files), len(files), sum(f[2] for f in files if f[0] == "prefix"))


def _touch(path: Path) -> None:
    """Mark `path` as just used. Explicit nanosecond times: the kernel's own "now" for file times is
    coarse (a few ms), which would tie entries written in a burst."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))
