"""KV memory of the running batch: accounting (own buffers plus shared blocks counted once) and the
pool the sequences' own KV lives in."""

from __future__ import annotations

import torch

from promptcache.model_runtime.engine.assembly import module_key
from promptcache.model_runtime.engine.request import Request, Sequence, SharedKV
from promptcache.model_runtime.kv_pool import KVPool
from promptcache.model_runtime.loading.loader import LoadedModel
from promptcache.model_runtime.module_encoder import ModuleEncoder


class KVMemory:
    """Tracks bytes reserved against a budget. Shared blocks are reference-counted by key."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.own_bytes = 0
        self.shared: dict[str, list[int]] = {}  # key -> [nbytes, refcount]

    @property
    def used_bytes(self) -> int:
        return self.own_bytes + sum(entry[0] for entry in self.shared.values())

    def cost(self, own_bytes: int, shared: dict[str, int]) -> int:
        """Bytes a new request would add: its own KV and the shared blocks not yet resident."""
        return own_bytes + sum(n for key, n in shared.items() if key not in self.shared)

    def fits(self, own_bytes: int, shared: dict[str, int]) -> bool:
        return self.used_bytes + self.cost(own_bytes, shared) <= self.max_bytes

    def reserve(self, own_bytes: int, shared: dict[str, int]) -> None:
        self.own_bytes += own_bytes
        for key, nbytes in shared.items():
            self.shared.setdefault(key, [nbytes, 0])[1] += 1
        assert self.used_bytes <= self.max_bytes, "KV budget exceeded"

    def release(self, own_bytes: int, shared: dict[str, int]) -> None:
        self.own_bytes -= own_bytes
        for key in shared:
            entry = self.shared[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self.shared[key]
        assert self.own_bytes >= 0


def request_bytes(request: Request, encoder: ModuleEncoder) -> tuple[int, dict[str, int]]:
    """Before assembly, a bound of the own KV bytes `request` adds and its shared blocks' bytes, by key."""
    reuse, params, per_token = request.reuse, request.params, encoder.loaded.kv_bytes_per_token
    assert reuse is not None
    shared: dict[str, int] = {}
    for use in reuse.uses:  # runs of one module (tokens recomputed between) share its block: held_bytes
        key = module_key(encoder, request, use)
        shared[key] = max(shared.get(key, 0), (use.last - use.first) * per_token)
    return (len(reuse.token_ids) + 1 + params.n * params.max_tokens) * per_token, shared


def held_bytes(shared: list[SharedKV], bytes_per_token: int) -> dict[str, int]:
    """Bytes of each stored block that `shared` KV (views cut from it included) holds, by store key."""
    held: dict[str, int] = {}
    for item in shared:
        held[item.view.key] = max(held.get(item.view.key, 0), item.block.num_tokens * bytes_per_token)
    return held


class OwnKV:
    """Running requests' own KV: KVPool slots held per request until `release` (no free range: buffers of their own)."""

    def __init__(self, loaded: LoadedModel, max_bytes: int) -> None:
        model = loaded.model
        self.pool = KVPool(num_layers=loaded.num_layers, num_kv_heads=loaded.num_kv_heads, head_dim=loaded.head_dim,
                           num_slots=max(1, max_bytes // loaded.kv_bytes_per_token), dtype=model.dtype,
                           device=model.device)
        self._held: dict[str, list[int]] = {}  # request id -> first slot of each of its sequences' ranges

    def attach(self, seq: Sequence, capacity: int) -> None:
        """Give `seq` (of a request) own KV for `capacity` tokens (at least one)."""
        capacity = max(capacity, 1)
        first = self.pool.allocate(capacity)
        if first is None:
            shape = (*self.pool.shape[:2], capacity, self.pool.shape[3])
            seq.own_keys = torch.empty(shape, dtype=self.pool.dtype, device=self.pool.device)
            seq.own_values = torch.empty(shape, dtype=self.pool.dtype, device=self.pool.device)
            return
        self._held.setdefault(seq.owner.request_id, []).append(first)
        seq.own_keys, seq.own_values = self.pool.slots(first, capacity)
        seq.own_pool, seq.own_slot = self.pool, first

    def release(self, request_id: str) -> None:
        """Free a request's slots (safe: its last readers, the step's prefix writes, run before the next pass)."""
        for first in self._held.pop(request_id, ()):
            self.pool.free(first)
