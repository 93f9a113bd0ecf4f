"""Shared-module attention inside HF models (transformers' attention registry). A pass feeds its sequences as ONE packed
row; `BatchCache` writes their new KV with one `index_copy_` per layer for those in one KVPool; the function attends
each shared segment once for all its queries (model_runtime.attention); plain SDPA outside a batch step."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from promptcache.model_runtime.attention import OwnPool, SharedSegment, StepIndices, shared_module_attention
from promptcache.model_runtime.attention.decode_batch import (
    StepDecode,
    decode_batch_type,
    kernel_takes,
    plan_step_decode,
)
from promptcache.model_runtime.attention.shared_prefix import (
    PassPositions,
    SharedPrefixPlan,
    kernel_serves,
    plan_shared_prefix,
)
from promptcache.model_runtime.attention.sliding_window import WindowedPass
from promptcache.model_runtime.kv_pool import KVPool


@dataclass(frozen=True, slots=True)
class OwnWrite:
    """Where a pass writes some sequences' new KV: rows `rows` of a layer's states [H_kv, total_q, D] to slots `slots`
    of `keys`/`values` [L, H_kv, N, D] (slices as views, else one index op each)."""

    keys: torch.Tensor
    values: torch.Tensor
    rows: slice | torch.Tensor
    slots: slice | torch.Tensor

    def __call__(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        for target, states in ((self.keys, key_states), (self.values, value_states)):
            new = states[:, self.rows] if isinstance(self.rows, slice) else states.index_select(1, self.rows)
            if isinstance(self.slots, slice):
                target[layer, :, self.slots].copy_(new)
            else:
                target[layer].index_copy_(1, self.slots, new)


ATTENTION_NAME = "promptcache_shared"
_active = threading.local()


@dataclass(eq=False)
class BatchContext:
    """Everything one packed forward pass needs to attend correctly (sequences in row order)."""

    query_lens: list[int]
    own_keys: list[torch.Tensor]     # per sequence [num_layers, num_kv_heads, capacity, head_dim]
    own_values: list[torch.Tensor]
    own_starts: list[int]            # own KV length before this step
    # ([L, H_kv, n, D] x2, sequences, per-sequence row offsets or None: see SharedSegment)
    segments: list[tuple[torch.Tensor, torch.Tensor, tuple[int, ...], tuple[int, ...] | None]]
    backend: str = "auto"
    # The pool of some sequences' own KV (own_keys[i] a view of its slots), per sequence its first slot (None: its own)
    pool: KVPool | None = None
    own_slots: list[int | None] | None = None
    # The pass's index tensors and own-KV writes, made on the host by the first layer, reused by the others.
    indices: StepIndices | None = field(default=None, repr=False)
    writes: list[OwnWrite] | None = field(default=None, repr=False)
    # The decoding sequences as one kernel call a layer (decode_batch.py), planned at the first; False: not taken
    decode: StepDecode | bool | None = field(default=None, repr=False)
    # The pass as one shared-prefix kernel call a layer (attention/shared_prefix.py), planned at the first; False: not
    # taken (another device, dtype or backend, a sequence outside the pool)
    shared_prefix: SharedPrefixPlan | bool | None = field(default=None, repr=False)
    # A step that also prefills: the prefilling sequences' own index tensors (their rows renumbered).
    others_indices: StepIndices | None = field(default=None, repr=False)
    # Deterministic serving: the step's AttentionPlan (model_runtime/deterministic/), which every sequence attends
    # through, each over its own logical key sequence; `segments` is then empty.
    deterministic: Any = field(default=None, repr=False)
    # A model with sliding-window layers: the pass's positions; a window layer it cuts attends through it alone.
    window: WindowedPass | None = field(default=None, repr=False)
    # Per window of the pass's cut layers: their `DecodeBatch` where every sequence decodes and the kernel takes it
    window_batches: dict[int, Any] = field(default_factory=dict, repr=False)
    # Per group of sequences attended by the general path: their own KV so far, per layer (keys, values).
    layer_views: dict[tuple[int, ...], list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]] = field(
        default_factory=dict, repr=False)

    def own_kv(self, seqs: tuple[int, ...], layer: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Own keys and values so far of `seqs` at `layer`: [H_kv, n, D] views, made once a pass."""
        by_layer = self.layer_views.get(seqs)
        if by_layer is None:
            lengths = [self.own_starts[i] + self.query_lens[i] for i in seqs]
            keys = zip(*(self.own_keys[i][:, :, :n].unbind(0) for i, n in zip(seqs, lengths)))
            values = zip(*(self.own_values[i][:, :, :n].unbind(0) for i, n in zip(seqs, lengths)))
            by_layer = self.layer_views[seqs] = list(zip(keys, values))
        return by_layer[layer]

    def plan_decode(self, query: torch.Tensor) -> StepDecode | bool:
        """The pass's decoding sequences as one kernel call per layer (False: the kernel does not take them)."""
        if self.decode is None:
            own_lens = [s + n for s, n in zip(self.own_starts, self.query_lens)]
            self.decode = plan_step_decode(query, self.query_lens, self.own_keys, self.own_values, own_lens,
                                           self.segments, self.backend) or False
        return self.decode

    def window_batch(self, query: torch.Tensor, layer: int) -> Any | None:
        """The `DecodeBatch` of what the pass's queries reach through `layer`'s window (`query`: [1, H, total_q, D]),
        planned once per window; None where not every sequence decodes or the kernel does not take the pass."""
        assert self.window is not None
        window = self.window.windows[layer]
        assert window is not None
        if window not in self.window_batches:
            batch = None
            if kernel_takes(query.dtype, query.device, query.shape[-1], self.query_lens, self.backend):
                own_lens = [s + n for s, n in zip(self.own_starts, self.query_lens)]
                parts = self.window.decode_parts(window, self.own_keys, self.own_values, own_lens)
                if parts is not None:
                    batch = decode_batch_type(query.dtype)(
                        parts.own_keys, parts.own_values, parts.own_lens, parts.segment_keys, parts.segment_values,
                        parts.segment_members)
            self.window_batches[window] = batch
        return self.window_batches[window]

    def plan_shared_prefix(self, query: torch.Tensor) -> SharedPrefixPlan | None:
        """The pass's tables for the shared-prefix kernel (`query`: the first layer's [1, H, Q, D]), or None."""
        if self.shared_prefix is None:
            plan = None
            if (self.deterministic is None and self.pool is not None and self.own_slots is not None
                    and kernel_serves(self.backend, query.device, query.dtype)):
                own_lens = [s + n for s, n in zip(self.own_starts, self.query_lens)]
                window = self.window
                positions = None if window is None else PassPositions(
                    window.query_positions, window.own_positions, window.segment_positions)
                plan = plan_shared_prefix(self.query_lens, own_lens, self.own_slots, self.pool.keys, self.pool.values,
                                          self.segments, num_heads=query.shape[1], positions=positions)
            self.shared_prefix = plan or False
        return self.shared_prefix if isinstance(self.shared_prefix, SharedPrefixPlan) else None

    def decode_batch(self, query: torch.Tensor) -> Any:
        """The `DecodeBatch` of an all-decode pass the kernel takes (`query`: the first layer's [B, H, D])."""
        decode = self.plan_decode(query.transpose(0, 1).unsqueeze(0))
        assert isinstance(decode, StepDecode) and decode.rows is None, "an all-decode step the kernel takes"
        return decode.batch

    def prepare(self, device: torch.device) -> StepIndices:
        """The pass's index tensors and own-KV writes (built at the first call)."""
        if self.indices is None:
            self.indices = StepIndices(device)
        if self.writes is None:
            self.writes = _own_writes(self, self.indices)
        return self.indices


class BatchCache(Cache):
    """The HF-facing cache of a packed batch step: routes new KV rows to each sequence's buffer."""

    def __init__(self, context: BatchContext, num_layers: int) -> None:
        self.context = context
        self.num_layers = num_layers
        super().__init__(layers=[])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states: [1, num_kv_heads, total_q, head_dim]; rows are the sequences' tokens in order.
        self.context.prepare(key_states.device)
        assert self.context.writes is not None, "prepare() makes the pass's writes"
        for write in self.context.writes:
            write(layer_idx, key_states[0], value_states[0])
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return query_length, 0  # the HF mask is ignored in a batch step; keep it tiny

    def __len__(self) -> int:
        return self.num_layers

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers


def _attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    ctx: BatchContext | None = getattr(_active, "context", None)
    if ctx is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    layer = module.layer_idx
    if ctx.window is not None and ctx.window.cuts(layer):  # [1, H, total_q, D] -> [total_q, H, D] -> [1, total_q, H, D]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if (kernel := ctx.plan_shared_prefix(query)) is not None:  # the GPU kernel, masking by positions
            out, _ = kernel.attend(query[0].transpose(0, 1), layer, scale, window=ctx.window.windows[layer])
            return out.unsqueeze(0), None
        if (batch := ctx.window_batch(query, layer)) is not None:  # every sequence decodes: the window's suffixes
            return batch.attend(query[0].transpose(0, 1), layer, scale)[0].unsqueeze(0), None
        everyone = tuple(range(len(ctx.query_lens)))
        own = ctx.window.attend(query[0].transpose(0, 1), layer, lambda at: ctx.own_kv(everyone, at), scale)
        return own.unsqueeze(0), None
    if ctx.deterministic is not None:  # [1, H, total_q, D] -> [total_q, H, D] -> [1, total_q, H, D]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return ctx.deterministic.attend(query[0].transpose(0, 1), layer, scale).unsqueeze(0), None
    indices = ctx.prepare(query.device)
    kernel = ctx.plan_shared_prefix(query)
    if kernel is not None:  # every sequence, segment and layer of the pass: one kernel pair
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return kernel.attend(query[0].transpose(0, 1), layer, scale)[0].unsqueeze(0), None  # [1, Q, H, D]
    ctx.plan_decode(query)
    queries = query[0].transpose(0, 1)  # [1, H, total_q, D] -> [total_q, H, D]
    if not isinstance(ctx.decode, StepDecode):
        everyone = tuple(range(len(ctx.query_lens)))
        out = _attend(ctx, queries, layer, everyone, ctx.segments, indices, scaling)
        return out.unsqueeze(0), None  # [1, total_q, H, D]
    decode = ctx.decode
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if decode.rows is None:  # every sequence decodes
        return decode.batch.attend(queries, layer, scale)[0].unsqueeze(0), None
    # Decoding sequences through the kernel, the prefilling ones through the general path, each by its rows.
    assert decode.other_rows is not None  # planned with `rows`
    if ctx.others_indices is None:
        ctx.others_indices = StepIndices(query.device)
    out = torch.empty_like(queries)
    out.index_copy_(0, decode.rows, decode.batch.attend(queries.index_select(0, decode.rows), layer, scale)[0])
    others = _attend(ctx, queries.index_select(0, decode.other_rows), layer, decode.others, decode.other_segments,
                     ctx.others_indices, scaling)
    out.index_copy_(0, decode.other_rows, others)
    return out.unsqueeze(0), None


def _attend(ctx: BatchContext, queries: torch.Tensor, layer: int, seqs: tuple[int, ...], segments,
            indices: StepIndices, scaling: float | None) -> torch.Tensor:
    """The general path (`shared_module_attention`) for sequences `seqs` of the step, whose query rows
    `queries` [T, H, D] holds in order; `segments` as they see them (members numbered among `seqs`)."""
    own_keys, own_values = ctx.own_kv(seqs, layer)
    layer_segments = [SharedSegment(keys=k[layer], values=v[layer], seq_indices=members, row_offsets=offsets)
                      for k, v, members, offsets in segments]
    pool = None
    if len(seqs) == len(ctx.query_lens) and ctx.pool is not None and ctx.own_slots is not None:
        pool = OwnPool(ctx.pool.keys[layer], ctx.pool.values[layer], tuple(ctx.own_slots))  # [H_kv, slots, D] x2
    return shared_module_attention(queries, [ctx.query_lens[i] for i in seqs], own_keys, own_values,
                                   layer_segments, scale=scaling, backend=ctx.backend, indices=indices,
                                   own_pool=pool, check=layer == 0)  # every layer's views share one layout


def _own_writes(ctx: BatchContext, indices: StepIndices) -> list[OwnWrite]:
    """A pass's KV writes: one for all pooled sequences, one per sequence with a buffer of its own."""
    writes, pooled_rows, pooled_slots, row = [], [], [], 0
    slots = ctx.own_slots or [None] * len(ctx.query_lens)
    for keys, values, start, n, first in zip(ctx.own_keys, ctx.own_values, ctx.own_starts, ctx.query_lens, slots):
        if first is None:
            writes.append(OwnWrite(keys, values, slice(row, row + n), slice(start, start + n)))
        else:  # the sequence's own KV position p is pool slot first + p
            pooled_rows.append((row, row + n))
            pooled_slots.append((first + start, first + start + n))
        row += n
    if pooled_rows:
        assert ctx.pool is not None, "pooled slots are slots of the pool"
        writes.append(OwnWrite(ctx.pool.keys, ctx.pool.values, indices.span(pooled_rows), indices.span(pooled_slots)))
    return writes


def install(model) -> None:
    """Route `model`'s attention through the shared-module function (SDPA outside batch steps)."""
    AttentionInterface.register(ATTENTION_NAME, _attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)


@contextlib.contextmanager
def active_batch(context: BatchContext) -> Iterator[BatchContext]:
    """Marks a packed batch forward pass on this thread."""
    _active.context = context
    try:
        yield context
    finally:
        _active.context = None


def cache_argument(model, cache) -> dict:
    """The keyword argument that hands `cache` to `model`'s forward: `cache` where the model takes it (transformers
    renamed `past_key_values` and warns on every call with the old name), else `past_key_values`."""
    return {_cache_keyword(type(model)): cache}  # type: ignore[arg-type]  # mypy takes classes for unhashable


def past_cache(outputs):
    """The KV cache a forward pass returned, under either name (see `cache_argument`)."""
    found = getattr(outputs, "cache", None)
    return found if found is not None else outputs.past_key_values


@functools.cache
def _cache_keyword(model_class: type[torch.nn.Module]) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"
