"""Shared-module attention: Hydragen's shared-prefix decomposition generalised to shared *sets*. Per layer, each
shared segment is attended ONCE by the queries of every sequence that includes it, each sequence's own KV causally,
and the parts merged exactly by log-sum-exp in fp32 (the bf16 kernel joins a sequence's private segments to its call).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from promptcache.model_runtime.attention import bf16_kernel, dispatch
from promptcache.model_runtime.attention.backends import matmul_attend
from promptcache.model_runtime.attention.dispatch import CAUSAL_FUSED_MIN_WORK, choose, decode_in_place
from promptcache.model_runtime.attention.gpu_backends import (
    CONCATENATED_MAX_BYTES,
    attend_concatenated,
    concatenated_reads_groups,
    gpu_attend,
)
from promptcache.model_runtime.attention.lse_merge import RowMerge
from promptcache.model_runtime.attention.own_decode import OwnPool, own_decode, own_decode_in_place
from promptcache.model_runtime.attention.step_indices import StepIndices


@dataclass(frozen=True, slots=True, eq=False)
class SharedSegment:
    """KV attended in full (referenced, not copied) by the queries of the sequences `seq_indices`; `row_offsets[j]`
    (default 0) skips the first queries of `seq_indices[j]`, positioned before it (a prefill among cached tokens)."""

    keys: torch.Tensor     # [num_kv_heads, seg_len, head_dim]
    values: torch.Tensor   # [num_kv_heads, seg_len, head_dim]
    seq_indices: tuple[int, ...]
    row_offsets: tuple[int, ...] | None = None


def shared_module_attention(queries: torch.Tensor, query_lens: Sequence[int], own_keys: Sequence[torch.Tensor],
                            own_values: Sequence[torch.Tensor], segments: Sequence[SharedSegment], *,
                            scale: float | None = None, backend: str = "auto", indices: StepIndices | None = None,
                            own_pool: OwnPool | None = None, check: bool = True) -> torch.Tensor:
    """queries [total_q, H, D] grouped by sequence; own_keys[i] [H_kv, S_i, D] (its last T_i keys are the queries' own
    tokens, attended causally). Returns [total_q, H, D]. `indices`: the pass's index tensors (None: fresh); `own_pool`:
    the pool own_keys are views of (decoding KV gathered in one call); `check=False` skips validation (later layers)."""
    total_q, num_heads, head_dim = queries.shape
    num_kv_heads = _validate(queries, query_lens, own_keys, own_values, segments) if check else own_keys[0].shape[0]
    if own_pool is not None and len(own_pool.first_slots) != len(query_lens):
        raise ValueError(f"own_pool has {len(own_pool.first_slots)} first slots for {len(query_lens)} sequences")
    group = num_heads // num_kv_heads
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    indices = indices if indices is not None else StepIndices(queries.device)
    starts = [0, *itertools.accumulate(query_lens)]

    if (len(query_lens) == 1 and backend != "matmul" and dispatch.on_gpu(queries)
            and own_keys[0].shape[1] >= total_q and not any(any(s.row_offsets or ()) for s in segments)
            # the K and V copies `attend_concatenated` makes (expanded to every query head unless read grouped)
            and 2 * (num_kv_heads if concatenated_reads_groups(queries) else num_heads) * head_dim
            * (own_keys[0].shape[1] + sum(s.keys.shape[1] for s in segments)) * queries.element_size()
            <= CONCATENATED_MAX_BYTES):
        # A lone sequence on a GPU: its KV concatenated, one fused call instead of a call and merge each.
        return attend_concatenated(queries, [*(s.keys for s in segments), own_keys[0]],
                                   [*(s.values for s in segments), own_values[0]], scale)
    kernel = bf16_kernel.loaded() if backend == "auto" else None
    private, shared = _split(kernel, queries, query_lens, own_keys, own_values, segments, backend)
    if len(query_lens) == 1 and private and not shared:  # a lone sequence, everything in one call
        return _attend_together(kernel, queries, private[0], own_keys[0], own_values[0], num_kv_heads, scale)

    merged = RowMerge(total_q, num_heads, head_dim, queries.device)
    merge = merged.add

    for same_rows in _by_rows(shared, queries if kernel is not None else None):
        first = same_rows[0]
        rows, num_rows = _rows(first.seq_indices, first.row_offsets, starts, indices)
        if num_rows == 0:
            continue
        q = _fold(queries[rows], num_kv_heads, group)                    # [H_kv, M*G, D]
        if kernel is not None and len(same_rows) > 1:  # the kernel reads the segments where they lie: one softmax
            out, lse = kernel(q, [s.keys for s in same_rows], [s.values for s in same_rows], scale, False)
        else:
            out, lse = choose(backend, q, first.keys)(q, first.keys, first.values, scale)
        whole = isinstance(rows, slice) and num_rows == total_q  # every row, in order
        merge(rows, *_unfold(out, lse, num_rows, num_kv_heads, group), whole=whole)

    decoding = [i for i in private if query_lens[i] == 1]
    if decoding:  # every decoding sequence's own KV and segments of its own: one batch-decode kernel call
        decode_kernel = bf16_kernel.decode_loaded()
        assert decode_kernel is not None  # private sequences exist only where the kernel is loaded
        rows = indices.positions([starts[i] for i in decoding])
        # q [B, H, D], each sequence over its segments and own KV -> out [B, H, D], lse [B, H]
        merge(rows, *decode_kernel(queries[rows], [[*(s.keys for s in private[i]), own_keys[i]] for i in decoding],
                                   [[*(s.values for s in private[i]), own_values[i]] for i in decoding], scale))
    for i, segs in private.items():
        if query_lens[i] == 1:
            continue
        rows = slice(starts[i], starts[i + 1])
        merge(rows, *_attend_together(kernel, queries[rows], segs, own_keys[i], own_values[i], num_kv_heads, scale,
                                      with_lse=True))
    decode = [i for i, n in enumerate(query_lens) if n == 1 and own_keys[i].shape[1] > 0 and i not in private]
    chosen = ({i for i in decode if decode_in_place(backend, queries, own_keys[i].shape[1])}
              if queries.device.type == "cpu" else set())  # in place: a CPU choice
    in_place, padded = [i for i in decode if i in chosen], [i for i in decode if i not in chosen]
    if padded:
        rows = indices.positions([starts[i] for i in padded])
        pool = None
        if own_pool is not None and all(own_pool.first_slots[i] is not None for i in padded):
            pool = own_pool._replace(first_slots=tuple(own_pool.first_slots[i] for i in padded))
        whole = len(padded) == total_q  # every row decodes, in order: no gather of the query rows
        merge(rows, *own_decode(queries, None if whole else rows, [own_keys[i] for i in padded],
                                [own_values[i] for i in padded], num_kv_heads, group, scale, indices, pool,
                                backend),
              whole=whole)
    if in_place:
        out, lse = own_decode_in_place(queries, [starts[i] for i in in_place], [own_keys[i] for i in in_place],
                                       [own_values[i] for i in in_place], num_kv_heads, scale)
        merge(indices.positions([starts[i] for i in in_place]), out, lse)
    for i, n in enumerate(query_lens):
        if n == 1 or i in private:
            continue
        rows = slice(starts[i], starts[i + 1])
        keys, values = own_keys[i], own_values[i]
        prefix = keys.shape[1] - n
        q = _fold(queries[rows], num_kv_heads, group)                       # [H_kv, T*G, D]
        if prefix > 0:  # own keys before the queries' own tokens: attended in full
            out, lse = choose(backend, q, keys[:, :prefix])(q, keys[:, :prefix], values[:, :prefix], scale)
            merge(rows, *_unfold(out, lse, n, num_kv_heads, group))
        # The queries' own tokens: a square causal block (top-left == bottom-right alignment).
        merge(rows, *_causal_square(queries[rows], keys[:, prefix:], values[:, prefix:], group, scale, backend))
    return merged.result(queries.dtype)


def _split(kernel, queries, query_lens, own_keys, own_values, segments, backend):
    """(private, shared): with the bf16 kernel, a sequence attends the segments only it sees (each from its row
    offset on) and its own KV in ONE call, no merges (decoding ones: one call for all); `private` maps each such
    sequence to its segments. `shared` holds every other non-empty segment, attended once by all its sequences."""
    joinable = {i for i in range(len(query_lens))
                if kernel is not None and bf16_kernel.eligible(queries, own_keys[i], own_values[i]) is not None}
    private: dict[int, list[SharedSegment]] = {i: [] for i in joinable}
    shared = []
    for segment in segments:
        if segment.keys.shape[1] == 0:
            continue  # an empty segment contributes nothing (and would crash the fused op)
        if (len(segment.seq_indices) == 1 and segment.seq_indices[0] in joinable
                and bf16_kernel.eligible(queries, segment.keys, segment.values) is not None):
            if _first_row(segment) < query_lens[segment.seq_indices[0]]:  # else no query of this step sees it
                private[segment.seq_indices[0]].append(segment)
        else:
            shared.append(segment)
    return private, shared


def _by_rows(shared: Sequence[SharedSegment], queries: torch.Tensor | None) -> list[list[SharedSegment]]:
    """Shared segments grouped by the query rows that see them: with the kernel (`queries` given), the segments it
    can read are grouped, each group one call over their list; otherwise one call each."""
    if queries is None:
        return [[segment] for segment in shared]
    groups: dict[object, list[SharedSegment]] = {}
    for segment in shared:
        eligible = bf16_kernel.eligible(queries, segment.keys, segment.values) is not None
        key = (segment.seq_indices, segment.row_offsets or (0,) * len(segment.seq_indices)) if eligible else id(segment)
        groups.setdefault(key, []).append(segment)
    return list(groups.values())


def _attend_together(kernel, q: torch.Tensor, segments: Sequence[SharedSegment], keys: torch.Tensor,
                     values: torch.Tensor, num_kv_heads: int, scale: float, *, with_lse: bool = False):
    """q [T, H, D] (one sequence) attends `segments` (each from its row offset on) and its own KV [H_kv, S, D]
    (causal) in one bf16-kernel call. Returns out [T, H, D] (q's dtype), and lse [T, H] with `with_lse`."""
    n, num_heads, head_dim = q.shape
    all_keys, all_values = [*(s.keys for s in segments), keys], [*(s.values for s in segments), values]
    first_rows = [*(_first_row(s) for s in segments), 0]
    if n == 1:  # decode: the GQA group as rows of one KV head, each head's KV read once (no offsets here)
        out, lse = kernel(q.view(num_kv_heads, -1, head_dim), all_keys, all_values, scale, False)  # [H_kv, G, D]
        out, lse = out.reshape(1, num_heads, head_dim), lse.reshape(1, num_heads)
    else:  # bottom-right causal over the concatenation: the own prefix in full, segments from their rows
        out, lse = kernel(q.transpose(0, 1), all_keys, all_values, scale, True, first_rows)  # [H, T, D], [H, T]
        out, lse = out.transpose(0, 1), lse.transpose(0, 1)
    return (out, lse) if with_lse else out


def _first_row(segment: SharedSegment) -> int:
    return segment.row_offsets[0] if segment.row_offsets else 0


def _causal_square(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, group: int, scale: float,
                   backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] attends causally to keys/values [H_kv, T, D]; returns out [T, H, D], lse [T, H]."""
    n, on_gpu = q.shape[0], dispatch.on_gpu(q)
    if backend != "matmul" and (on_gpu or (q.device.type == "cpu" and n * n * group >= CAUSAL_FUSED_MIN_WORK)):
        # The fused ops need equal head counts: expand the T own tokens' KV (small next to the shared KV).
        k = (keys if group == 1 else keys.repeat_interleave(group, dim=0)).unsqueeze(0)      # [1, H, T, D]
        v = (values if group == 1 else values.repeat_interleave(group, dim=0)).unsqueeze(0)
        q4 = q.transpose(0, 1).unsqueeze(0)                                                  # [1, H, T, D]
        out, lse = (gpu_attend(q4, k, v, scale, causal=True) if on_gpu  # [1, H, T, D], [1, H, T]
                    else torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q4, k, v, 0.0, True, scale=scale))
        return out[0].transpose(0, 1), lse[0].transpose(0, 1)
    num_kv_heads = keys.shape[0]
    # Masks are cached for CPU tensors only: on a GPU a cache would hold [T*G, T] masks in its memory.
    mask = _causal_mask(n, group) if q.device.type == "cpu" else _make_causal_mask(n, group, q.device)
    out, lse = matmul_attend(_fold(q, num_kv_heads, group), keys, values, scale, mask)
    return _unfold(out, lse, n, num_kv_heads, group)


@functools.lru_cache(maxsize=64)
def _causal_mask(n: int, group: int) -> torch.Tensor:
    """`_make_causal_mask` on the CPU, built once per size: every layer of every step with T new tokens asks."""
    return _make_causal_mask(n, group, torch.device("cpu"))


def _make_causal_mask(n: int, group: int, device: torch.device) -> torch.Tensor:
    """[T*G, T] bool, True = attend: row t*G+g (query t, head g of its KV group) sees keys 0..t."""
    return torch.ones((n, n), dtype=torch.bool, device=device).tril().repeat_interleave(group, dim=0)


def _rows(seq_indices: Sequence[int], row_offsets: Sequence[int] | None, starts: list[int],
          indices: StepIndices) -> tuple[torch.Tensor | slice, int]:
    """The query rows that see a segment (`StepIndices.span`) and how many."""
    offsets = row_offsets or [0] * len(seq_indices)
    spans = [(min(starts[i] + off, starts[i + 1]), starts[i + 1]) for i, off in zip(seq_indices, offsets)]
    spans = [(first, end) for first, end in spans if first < end]
    return indices.span(spans), sum(end - first for first, end in spans)


def _fold(q: torch.Tensor, num_kv_heads: int, group: int) -> torch.Tensor:
    # [M, H, D] -> [M, H_kv, G, D] -> [H_kv, M, G, D] -> [H_kv, M*G, D]: one KV head's queries in a block
    m, _, d = q.shape
    return q.view(m, num_kv_heads, group, d).permute(1, 0, 2, 3).reshape(num_kv_heads, m * group, d)


def _unfold(out: torch.Tensor, lse: torch.Tensor, m: int, num_kv_heads: int, group: int):
    # [H_kv, M*G, D] -> [M, H, D] and [H_kv, M*G] -> [M, H]
    d = out.shape[-1]
    out = out.view(num_kv_heads, m, group, d).permute(1, 0, 2, 3).reshape(m, num_kv_heads * group, d)
    lse = lse.view(num_kv_heads, m, group).permute(1, 0, 2).reshape(m, num_kv_heads * group)
    return out, lse


def _validate(queries, query_lens, own_keys, own_values, segments) -> int:
    if queries.dim() != 3:
        raise ValueError(f"queries must be [total_q, heads, head_dim], got {tuple(queries.shape)}")
    if sum(query_lens) != queries.shape[0] or any(n < 1 for n in query_lens):
        raise ValueError(f"query_lens {list(query_lens)} must be >= 1 and sum to {queries.shape[0]}")
    if len(own_keys) != len(query_lens) or len(own_values) != len(query_lens):
        raise ValueError("one own_keys/own_values entry per sequence is required")
    kv = [*own_keys, *(s.keys for s in segments)]
    num_kv_heads = kv[0].shape[0]
    for tensor in kv:
        if tensor.dim() != 3 or tensor.shape[0] != num_kv_heads or tensor.shape[2] != queries.shape[2]:
            raise ValueError(f"KV tensors must be [{num_kv_heads}, n, {queries.shape[2]}], got {tuple(tensor.shape)}")
    if queries.shape[1] % num_kv_heads:
        raise ValueError(f"{queries.shape[1]} query heads are not a multiple of {num_kv_heads} KV heads")
    for i, (keys, n) in enumerate(zip(own_keys, query_lens)):
        if keys.shape[1] and keys.shape[1] < n:
            raise ValueError(f"sequence {i} has {n} queries but only {keys.shape[1]} own keys")
    for segment in segments:
        if not segment.seq_indices or any(not 0 <= i < len(query_lens) for i in segment.seq_indices):
            raise ValueError(f"segment seq_indices {segment.seq_indices} out of range")
        if segment.row_offsets is not None and (len(segment.row_offsets) != len(segment.seq_indices)
                                                or min(segment.row_offsets) < 0):
            raise ValueError(f"segment row_offsets {segment.row_offsets} must be >= 0, one per sequence")
    return num_kv_heads
