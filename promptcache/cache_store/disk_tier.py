"""A shared tier on local disk: one file per block (same format as Redis), LRU per kind by access time.
`<key>.kv` holds a "module" entry, `<key>.pkv` a "prefix" one (eviction ranks files from a listing alone). A
file with a TTL starts with `PCEX` and its expiry (wall-clock seconds, f64). A file that fails verification
is a miss, never marked as used, and is removed unless a write replaced it meanwhile (writes rename whole files).
A lookup for part of a block (`reach`, a sliding window's) reads the file's head and then only that part."""

from __future__ import annotations

import os
import struct
import threading
import time
from pathlib import Path
from typing import BinaryIO

from promptcache.cache_store.block import KVBlock
from promptcache.cache_store.block_format import dumps, loads, read_part
from promptcache.cache_store.block_layout import HEADER_BYTES, Ranges
from promptcache.cache_store.errors import CacheStoreError, logger
from promptcache.cache_store.layer_reach import LayerReach
from promptcache.cache_store.tier import BlockKind, Eviction, Tier, TierHit, TierUsage
from promptcache.cache_store.verified_heads import VerifiedHeads, fingerprint

_SUFFIXES: dict[BlockKind, str] = {"module": ".kv", "prefix": ".pkv"}
_KINDS = {suffix: kind for kind, suffix in _SUFFIXES.items()}
_EXPIRY = struct.Struct("<4sd")
_EXPIRY_MAGIC = b"PCEX"
_HEAD_BYTES = _EXPIRY.size + HEADER_BYTES  # the expiry (if any) and the block header with its checksum


class DiskTier(Tier):
    """Blocks as files under `directory`, shared by processes on one host. Evicts "prefix" files (oldest
    access first) before "module" files; never pins (the disk tier is the last resort)."""

    is_shared = True

    def __init__(self, directory: str | Path, *, max_bytes: int, name: str = "disk") -> None:
        self.name = name
        self.max_bytes = max_bytes
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._heads = VerifiedHeads()
        self.bytes_read = 0  # of block files, whole or in part (what fetches cost)

    def _path(self, key: str, kind: BlockKind = "module") -> Path:
        if not key.isalnum():
            raise CacheStoreError(f"disk tier keys must be alphanumeric, got {key!r}")
        return self.directory / f"{key}{_SUFFIXES[kind]}"

    def lookup(self, key: str, reach: LayerReach | None = None) -> TierHit | None:
        for kind in ("module", "prefix"):
            path = self._path(key, kind)
            try:
                with path.open("rb") as file:
                    stat = os.fstat(file.fileno())
                    if reach is not None and not reach.is_whole and (part := self._read_part(key, file, reach)):
                        _touch(path)
                        return TierHit(part[0], kind, part[1])
                    data = file.read()
                    self.bytes_read += len(data)
            except OSError:
                continue
            hit = self._verify(key, kind, path, stat, data)
            if hit is not None:
                _touch(path)  # only a verified file counts as used
            return hit
        return None

    def _read_part(self, key: str, file: BinaryIO, reach: LayerReach) -> tuple[KVBlock, float | None] | None:
        """(the part of the file's block `reach` reads, its TTL), or None: expired, an older format or failing
        verification, for the whole read to judge (and drop)."""
        fd = file.fileno()

        def read(ranges: Ranges) -> list[bytes]:
            pieces = [os.pread(fd, stop - start, start) for start, stop in ranges]
            self.bytes_read += sum(map(len, pieces))
            return pieces

        expiry = os.pread(fd, _EXPIRY.size, 0)
        base, ttl_s = 0, None
        if expiry[:4] == _EXPIRY_MAGIC and len(expiry) == _EXPIRY.size:
            base, ttl_s = _EXPIRY.size, _EXPIRY.unpack(expiry)[1] - time.time()
            if ttl_s <= 0:
                return None
        try:
            block = read_part(read, reach, expect_key=key, base=base)
        except CacheStoreError:
            return None
        return None if block is None else (block, ttl_s)

    def _verify(self, key: str, kind: BlockKind, path: Path, stat: os.stat_result, data: bytes) -> TierHit | None:
        """The entry in `data` (the file at `path`, whose stat is `stat`), or None: expired or failed
        verification (logged), and removed unless replaced meanwhile."""
        ttl_s, blob = None, memoryview(data)
        try:
            if data[:4] == _EXPIRY_MAGIC:
                if len(data) < _EXPIRY.size:
                    raise CacheStoreError(f"a {len(data)}-byte file is shorter than its expiry header")
                ttl_s = _EXPIRY.unpack_from(data)[1] - time.time()
                if ttl_s <= 0:
                    _unlink_if_unchanged(path, stat)
                    return None
                blob = blob[_EXPIRY.size:]
            block = loads(blob, expect_key=key)
        except CacheStoreError as exc:
            logger.warning("dropping corrupted KV file %s: %s", path.name, exc)
            self._heads.forget(key)
            _unlink_if_unchanged(path, stat)
            return None
        self._heads.remember(key, fingerprint(len(data), data[:_HEAD_BYTES]))
        return TierHit(block, kind, ttl_s)

    def put(self, key: str, block: KVBlock, *, pinned: bool = False, ttl_s: float | None = None,
            kind: BlockKind = "module", owner: str | None = None) -> list[Eviction]:
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
            self._heads.remember(key, fingerprint(len(blob), blob[:_HEAD_BYTES]))  # what we write, we trust
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

    def _scan(self) -> list[tuple[BlockKind, int, int, os.DirEntry[str]]]:
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
        """True if `key` has an unexpired file that passes verification (only its first bytes for a file
        verified here before). Never marks it as used."""
        for kind in ("module", "prefix"):
            path = self._path(key, kind)
            try:
                with path.open("rb") as file:
                    stat = os.fstat(file.fileno())
                    head = file.read(_HEAD_BYTES)
                    if self._heads.vouches(key, fingerprint(stat.st_size, head)):
                        return head[:4] != _EXPIRY_MAGIC or _EXPIRY.unpack_from(head)[1] > time.time()
                    data = head + file.read()
            except OSError:
                continue
            return self._verify(key, kind, path, stat, data) is not None
        return False

    def delete(self, key: str) -> bool:
        self._heads.forget(key)
        paths = [self._path(key, kind) for kind in _SUFFIXES]
        existed = any([path.is_file() for path in paths])
        for path in paths:
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
    """Mark `path` as just used, in nanoseconds: the kernel's own "now" for file times (a few ms) would tie
    entries written in a burst."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def _unlink_if_unchanged(path: Path, stat: os.stat_result) -> None:
    """Remove `path` if it still is the file `stat` describes (a rightful write since is another inode)."""
    try:
        now = os.stat(path)
    except OSError:
        return
    if (now.st_dev, now.st_ino) == (stat.st_dev, stat.st_ino):
        path.unlink(missing_ok=True)
