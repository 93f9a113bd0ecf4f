"""An in-process tier (the model's device, or host memory): LRU under a byte budget, pins, TTLs."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from promptcache.cache_store.block import KVBlock
from promptcache.cache_store.errors import CapacityError
from promptcache.cache_store.tier import Tier


@dataclass(slots=True)
class _Entry:
    block: KVBlock
    nbytes: int
    pinned: bool
    expires_at: float | None


class MemoryTier(Tier):
    """Blocks held as tensors on `device`. Thread-safe. Pinned entries are never evicted; when only
    pinned data is left and a block does not fit, `put` raises CapacityError instead of overflowing."""

    def __init__(self, name: str, max_bytes: int, device: str = "cpu", *, pin_memory: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_bytes <= 0:
            raise ValueError(f"tier {name!r} needs max_bytes > 0, got {max_bytes}")
        self.name = name
        self.max_bytes = max_bytes
        self.device = torch.device(device)
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> KVBlock | None:
        with self._lock:
            entry = self._live(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry.block

    def put(self, key: str, block: KVBlock, *, pinned: bool = False,
            ttl_s: float | None = None) -> list[tuple[str, KVBlock]]:
        block = block.to(self.device, pin_memory=self.pin_memory)
        nbytes = block.nbytes
        if nbytes > self.max_bytes:
            raise CapacityError(f"a {nbytes}-byte block exceeds tier {self.name!r}'s budget of {self.max_bytes}")
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= old.nbytes
                pinned = pinned or old.pinned
            evicted = []
            for victim in [k for k, e in self._entries.items() if not e.pinned]:
                if self._used + nbytes <= self.max_bytes:
                    break
                entry = self._entries.pop(victim)
                self._used -= entry.nbytes
                evicted.append((victim, entry.block))
            if self._used + nbytes > self.max_bytes:
                for victim, victim_block in evicted:  # undo: the block cannot fit beside pinned data
                    self._entries[victim] = _Entry(victim_block, victim_block.nbytes, False, None)
                    self._used += victim_block.nbytes
                raise CapacityError(f"tier {self.name!r} holds {self._used} pinned bytes; a {nbytes}-byte block "
                                    f"does not fit in {self.max_bytes}")
            expires = None if ttl_s is None else self._clock() + ttl_s
            self._entries[key] = _Entry(block, nbytes, pinned, expires)
            self._used += nbytes
            return evicted

    def contains(self, key: str) -> bool:
        with self._lock:
            return self._live(key) is not None

    def delete(self, key: str) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._used -= entry.nbytes
            return entry is not None

    def pin(self, key: str) -> bool:
        return self._set_pin(key, True)

    def unpin(self, key: str) -> bool:
        return self._set_pin(key, False)

    @property
    def used_bytes(self) -> int:
        return self._used

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def _set_pin(self, key: str, pinned: bool) -> bool:
        with self._lock:
            entry = self._live(key)
            if entry is not None:
                entry.pinned = pinned
            return entry is not None

    def _live(self, key: str) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at is not None and self._clock() >= entry.expires_at:
            del self._entries[key]
            self._used -= entry.nbytes
            return None
        return entry
