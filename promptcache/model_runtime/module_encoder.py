"""Module encoding: the KV of schema segments at their layout positions, keyed by (segment, context). A context
chain Z0..Zk is built left to right: stored links are reused, the missing tail is computed by the engine's encode
queue (engine/encoding.py) and stored link by link, equal to a full prefill of the chain's tokens."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypedDict

import torch

from promptcache.cache_store import BlockKind, FetchPolicy, KVBlock, LayerReach, Tier, make_kv_key, window_reach
from promptcache.model_runtime.errors import PromptTooLongError
from promptcache.model_runtime.loading.loader import LoadedModel
from promptcache.pml import Schema, Segment


class KVStore(Protocol):
    """The store interface the runtime needs (cache_store.TieredStore implements it)."""

    policy: FetchPolicy  # decides whether fetching from a shared tier beats recomputing

    def get(self, key: str, *, num_tokens: int | None = None, nbytes: int | None = None, promote: bool = True,
            reach: LayerReach | None = None) -> tuple[KVBlock, str] | None: ...

    def put(self, key: str, block: KVBlock, *, pinned: bool = False, ttl_s: float | None = None,
            kind: Literal["module", "prefix"] = "module", owner: str | None = None, local: bool = True) -> None: ...

    def tier_of(self, key: str) -> Tier | None: ...

    def touch(self, keys: Iterable[str]) -> None: ...

    def delete(self, key: str) -> bool: ...

    def acquire(self, keys: Iterable[str]) -> None: ...

    def release(self, keys: Iterable[str]) -> None: ...


class _Cost(TypedDict):
    """What a store fetch costs, for the fetch policy (KVStore.get's keywords)."""

    num_tokens: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class ChainWork:
    """Encoding one missing segment: its chain's stored links (`found`), then the tail segments, their keys and kinds,
    tokens and positions, stored for `owner` (a tenant's byte share)."""

    target: str
    found: tuple[KVBlock, ...]
    segments: tuple[Segment, ...]
    keys: tuple[str, ...]
    token_ids: list[int]
    position_ids: list[int]
    owner: str | None
    kinds: tuple[BlockKind, ...]  # per key; "prefix": a second encoding, evicted before first encodings


@dataclass(frozen=True, slots=True)
class EncodeReport:
    num_segments: int
    num_encoded: int
    encode_ms: float


class ModuleEncoder:
    """Plans, stores and fetches segment KV (engine/encoding.py computes it); counters are locked."""

    def __init__(self, loaded: LoadedModel, store: KVStore) -> None:
        self.loaded = loaded
        self.store = store
        self._lock = threading.Lock()
        self.num_encoded_segments = 0

    def key(self, schema: Schema, segment_id: int, context_ids: Sequence[int], cache_salt: str | None) -> str:
        segment, loaded = schema.segments[segment_id], self.loaded
        return make_kv_key(model_fingerprint=loaded.model_fingerprint, token_ids=segment.token_ids,
                           tokenizer_fingerprint=loaded.tokenizer_fingerprint, position_ids=segment.position_ids,
                           context_digest=schema.context_digest(context_ids), cache_salt=cache_salt)

    def fetch(self, schema: Schema, segment_id: int, context_ids: Sequence[int], cache_salt: str | None = None, *,
              reach: LayerReach | None = None) -> tuple[KVBlock, str] | None:
        """(KV, tier) of `segment_id` encoded after `context_ids` from the store, or None: no tier holds it,
        or only one the fetch policy skips (recomputing measured faster). Computes nothing. `reach`: what of it the
        request reads (sliding-window layers read its last tokens only), the part a shared tier fetches."""
        return self.store.get(self.key(schema, segment_id, context_ids, cache_salt), reach=reach,
                              **self._cost(schema, segment_id, reach))

    def plan(self, schema: Schema, segment_id: int, context_ids: Sequence[int], cache_salt: str | None = None, *,
             owner: str | None = None, assume_missing: bool = False, local: bool = True) -> ChainWork | None:
        """What encoding `segment_id` after `context_ids` for `owner` needs: its chain's stored links and the
        missing tail; None when stored already. `local=False`: links are read without promotion here."""
        target = self.key(schema, segment_id, context_ids, cache_salt)
        if not assume_missing and self.store.tier_of(target) is not None:
            return None
        chain = [*sorted(context_ids, key=lambda i: schema.segments[i].start), segment_id]
        found: list[KVBlock] = []
        for index, link in enumerate(chain[:-1]):
            # No query of the encoding comes before the next link's first token: a window reads this link's tail.
            reach = window_reach(self.loaded.layer_windows, schema.segments[link].position_ids,
                                 schema.segments[chain[index + 1]].start)
            hit = self.store.get(self.key(schema, link, chain[:index], cache_salt), promote=local, reach=reach,
                                 **self._cost(schema, link, reach))
            if hit is None:
                break
            found.append(hit[0])
        segments = [schema.segments[i] for i in chain[len(found):]]
        token_ids = [t for s in segments for t in s.token_ids]
        position_ids = [p for s in segments for p in s.position_ids]
        check_positions(position_ids, self.loaded.max_positions)
        tail = list(zip(range(len(found), len(chain)), chain[len(found):]))
        keys = [self.key(schema, sid, chain[:index], cache_salt) for index, sid in tail]
        kinds: tuple[BlockKind, ...] = tuple(
            "prefix" if is_second_encoding(schema, sid, chain[:index]) else "module" for index, sid in tail)
        return ChainWork(target, tuple(found), tuple(segments), tuple(keys), token_ids, position_ids, owner, kinds)

    def store_tail(self, work: ChainWork, keys: torch.Tensor, values: torch.Tensor, *, local: bool = True) -> KVBlock:
        """Store the computed tail ([L, H_kv, tail tokens, D]) by segment; returns the target's block."""
        offset, block = 0, None
        for segment, key, kind in zip(work.segments, work.keys, work.kinds):
            n = len(segment.token_ids)
            positions = torch.tensor(list(segment.position_ids), dtype=torch.long)  # [n]
            block = KVBlock(keys[:, :, offset: offset + n].clone(), values[:, :, offset: offset + n].clone(), positions)
            self.store.put(key, block, kind=kind, owner=work.owner, local=local)
            offset += n
        assert block is not None
        return block

    def record(self, work: ChainWork, seconds: float) -> None:
        """Count an encoding and tell the fetch policy what recomputing cost."""
        self.store.policy.record_recompute(len(work.token_ids), seconds)
        with self._lock:
            self.num_encoded_segments += len(work.segments)

    def _cost(self, schema: Schema, segment_id: int, reach: LayerReach | None = None) -> _Cost:
        num_tokens = len(schema.segments[segment_id].token_ids)
        per_token = self.loaded.kv_bytes_per_token + 8  # + the int64 position id
        nbytes = num_tokens * per_token
        if reach is not None:  # a part costs its share of the bytes
            nbytes = reach.share_of(nbytes, num_tokens)
        return {"num_tokens": num_tokens, "nbytes": nbytes}

    def schema_jobs(self, schema: Schema, *, predecessors: bool = False) -> list[tuple[int, tuple[int, ...]]]:
        """(segment, context) of every cached segment's default KV and each scaffold's joint KV; `predecessors`:
        also each module's encoding after the module before it (fidelity context "predecessor")."""
        jobs = [(s.segment_id, s.context_ids) for s in schema.segments if s.is_cached and not s.is_placeholder]
        if predecessors:
            preceded = [(sid, schema.predecessor_context(sid, ctx)) for sid, ctx in jobs]
            jobs += [(sid, ctx) for sid, ctx in preceded if ctx is not None]
        for scaffold in schema.scaffolds:
            jobs += [(sid, ctx) for sid, ctx in scaffold.contexts.items()
                     if ctx != schema.segments[sid].context_ids and not schema.segments[sid].is_placeholder]
        return jobs


def is_second_encoding(schema: Schema, segment_id: int, context_ids: Sequence[int]) -> bool:
    """True when (segment, context) is a module's second encoding (fidelity context "predecessor"), not one its
    schema or a scaffold names: stored as kind "prefix", evicted before first encodings, remade on next use."""
    segment, context = schema.segments[segment_id], tuple(context_ids)
    if context == tuple(segment.context_ids) or any(s.contexts.get(segment_id) == context for s in schema.scaffolds):
        return False
    return context == schema.predecessor_context(segment_id, segment.context_ids)


def check_positions(position_ids: Sequence[int], max_positions: int) -> None:
    """Raise PromptTooLongError if a position is beyond what the model was trained for."""
    if position_ids and max(position_ids) >= max_positions:
        raise PromptTooLongError(f"the prompt uses position {max(position_ids)}, but the model supports "
                                 f"positions below {max_positions}")
