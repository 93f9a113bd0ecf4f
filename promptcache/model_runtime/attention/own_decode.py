"""Decoding sequences' own KV without padding every sequence to the longest: packed end to end for the GPU's varlen
flash op, by length bucket for the fp32 batch calls elsewhere (gathered from the pool where it lies), or one fused
CPU call each for long KV."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from promptcache.model_runtime.attention import dispatch
from promptcache.model_runtime.attention.gpu_backends import flash_applicable
from promptcache.model_runtime.attention.step_indices import StepIndices


class OwnPool(NamedTuple):
    """Sequences' own KV as slots of one pool, one layer of it: keys/values [H_kv, num_slots, D];
    sequence i's own KV position p is slot first_slots[i] + p (None: that sequence is not in the pool)."""

    keys: torch.Tensor
    values: torch.Tensor
    first_slots: tuple[int | None, ...]


def own_decode_in_place(queries: torch.Tensor, rows: Sequence[int], own_keys: Sequence[torch.Tensor],
                        own_values: Sequence[torch.Tensor], num_kv_heads: int, scale: float):
    """One fused CPU call per single-token sequence (query row rows[b]) over its own KV where it lies: for long
    own KV, copying it into a packed batch costs more than the calls. Returns out [B, H, D], lse [B, H]."""
    head_dim = queries.shape[-1]
    outs, lses = [], []
    for row, keys, values in zip(rows, own_keys, own_values):
        q = queries[row].view(1, num_kv_heads, -1, head_dim)                                  # [1, H_kv, G, D]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, keys.unsqueeze(0), values.unsqueeze(0), 0.0, False, scale=scale)[:2]
        outs.append(out.reshape(-1, head_dim))                                                # [H, D]
        lses.append(lse.reshape(-1))                                                          # [H]
    return torch.stack(outs), torch.stack(lses)                                               # [B, H, D], [B, H]


def own_decode(queries: torch.Tensor, rows: torch.Tensor | None, own_keys: Sequence[torch.Tensor],
               own_values: Sequence[torch.Tensor], num_kv_heads: int, group: int, scale: float,
               indices: StepIndices, pool: OwnPool | None = None, backend: str = "auto"):
    """Single-token sequences (query rows `rows`; None: all, in order) over their own KV, never padded to the
    longest. On a GPU in fp16/bf16: the KV packed end to end, in its dtype, through torch's varlen flash op.
    Elsewhere: sequences grouped by length bucket (powers of two), each bucket one masked fp32 batch call padded to
    its own longest (under 2x each sequence's length). KV is gathered from `pool` by one index_select each, else
    concatenated first. Returns out [B, H, D] (the flash op: queries' dtype, else fp32), lse [B, H] fp32."""
    lengths = tuple(k.shape[1] for k in own_keys)
    head_dim = queries.shape[-1]
    q = queries if rows is None else queries[rows]                                   # [B, H, D]
    source, layout = _source(pool, own_keys, own_values)
    if backend != "matmul" and dispatch.on_gpu(q) and flash_applicable(q):
        keys, values = source  # [N, H_kv, D] each unless read from the pool
        if pool is not None:  # packed by one index_select each
            flat = indices.get(("own_packed", layout, lengths), lambda: _packed_rows(layout, lengths, num_kv_heads))
            keys, values = (t.view(-1, head_dim).index_select(0, flat).view(-1, num_kv_heads, head_dim)
                            for t in source)                                           # [N, H_kv, D] x2
        return _varlen_flash(q, keys, values, lengths, scale, indices)
    buckets = _buckets(lengths)
    flat = indices.get(("own_buckets", layout, lengths),
                       lambda: _bucket_rows(buckets, lengths, layout, num_kv_heads))  # [sum B_k * H_kv * W_k]
    keys, values = (t.view(-1, head_dim).index_select(0, flat).float() for t in source)  # [sum B_k*H_kv*W_k, D]
    padding = indices.get(("own_bucket_padding", lengths), lambda: _bucket_padding(buckets, lengths))
    outs, lses, first, first_pad = [], [], 0, 0
    for members, width in zip(buckets.members, buckets.widths):
        size, num_members = len(members) * num_kv_heads * width, len(members)
        shape = (num_members, num_kv_heads, width, head_dim)
        k, v = keys[first: first + size].view(shape), values[first: first + size].view(shape)  # [B_k, H_kv, W, D]
        q_k = q if len(buckets.members) == 1 else q.index_select(0, indices.positions(members))
        q_k = q_k.float().view(num_members, num_kv_heads, group, head_dim)                   # [B_k, H_kv, G, D]
        scores = torch.matmul(q_k, k.transpose(-1, -2)) * scale                               # [B_k, H_kv, G, W]
        if any(lengths[b] < width for b in members):
            pad = padding[first_pad: first_pad + num_members * width].view(num_members, 1, 1, width)
            scores = scores.masked_fill(pad, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)                                                 # [B_k, H_kv, G]
        out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v)                          # [B_k, H_kv, G, D]
        outs.append(out.reshape(num_members, -1, head_dim))                                   # [B_k, H, D]
        lses.append(lse.reshape(num_members, -1))                                             # [B_k, H]
        first, first_pad = first + size, first_pad + num_members * width
    if len(outs) == 1:
        return outs[0], lses[0]
    # Buckets hold the sequences out of order: row b of the result is row order[b] of the concatenation.
    order = indices.get(("own_bucket_order", lengths), lambda: torch.argsort(torch.tensor(
        [b for members in buckets.members for b in members])))
    return torch.cat(outs).index_select(0, order), torch.cat(lses).index_select(0, order)  # [B, H, D], [B, H]


class _Layout(NamedTuple):
    """Where key j of KV head h of sequence b lies among the source's [rows, D]: h * head_stride + (firsts[b] + j)
    * position_stride (a pool's [H_kv, slots, D], or the packed [N, H_kv, D] concatenation)."""

    firsts: tuple[int, ...]
    head_stride: int
    position_stride: int


def _source(pool: OwnPool | None, own_keys: Sequence[torch.Tensor],
            own_values: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, torch.Tensor], _Layout]:
    """The tensors own KV is read from and its layout in them: the pool as it lies, else the sequences' KV
    concatenated end to end ([N, H_kv, D], one copy each for keys and values)."""
    num_kv_heads = own_keys[0].shape[0]
    if pool is not None:
        firsts = tuple(int(first) for first in pool.first_slots)  # type: ignore[arg-type]  # all pooled here
        return (pool.keys, pool.values), _Layout(firsts, pool.keys.shape[1], 1)
    starts = tuple(itertools.accumulate((k.shape[1] for k in own_keys[:-1]), initial=0))
    packed = (torch.cat([k.transpose(0, 1) for k in own_keys]),                       # [N, H_kv, D]
              torch.cat([v.transpose(0, 1) for v in own_values]))
    return packed, _Layout(starts, 1, num_kv_heads)


def _varlen_flash(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: tuple[int, ...], scale: float,
                  indices: StepIndices) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, D], one query per sequence, over packed keys/values [N, H_kv, D] (sequence b's keys at
    offsets[b]..offsets[b+1]) in one varlen flash call, GQA read natively. Returns out [B, H, D], lse [B, H] fp32."""
    batch, num_heads, _ = q.shape
    query_offsets = indices.get(("own_query_offsets", batch), lambda: torch.arange(batch + 1, dtype=torch.int32))
    key_offsets = indices.get(("own_key_offsets", lengths), lambda: torch.tensor(
        [0, *itertools.accumulate(lengths)], dtype=torch.int32))                     # [B + 1]
    out, lse = torch.ops.aten._flash_attention_forward(
        q, keys, values, query_offsets, key_offsets, 1, max(lengths), 0.0, False, False, scale=scale)[:2]
    # The varlen lse is [H, total_q] (older builds: [B, H, max_q], max_q = 1).
    lse = lse.transpose(0, 1) if lse.shape == (num_heads, batch) else lse.reshape(batch, num_heads)
    return out, lse.float()


class _Buckets(NamedTuple):
    """Sequences grouped by the power of two their own length rounds up to: each group's members (in order) and
    the longest member's length, the width its batch call is padded to."""

    members: tuple[tuple[int, ...], ...]
    widths: tuple[int, ...]


def _buckets(lengths: tuple[int, ...]) -> _Buckets:
    by_bucket: dict[int, list[int]] = {}
    for b, n in enumerate(lengths):
        by_bucket.setdefault((n - 1).bit_length(), []).append(b)
    members = tuple(tuple(by_bucket[key]) for key in sorted(by_bucket))
    return _Buckets(members, tuple(max(lengths[b] for b in group) for group in members))


def _packed_rows(layout: _Layout, lengths: tuple[int, ...], num_kv_heads: int) -> torch.Tensor:
    """int64 [N * H_kv]: the source row of packed key n (key j of sequence b), KV head h, n-major."""
    positions = torch.cat([torch.arange(first, first + n) for first, n in zip(layout.firsts, lengths)])  # [N]
    heads = torch.arange(num_kv_heads) * layout.head_stride                                              # [H_kv]
    return (positions[:, None] * layout.position_stride + heads[None, :]).reshape(-1)


def _bucket_rows(buckets: _Buckets, lengths: tuple[int, ...], layout: _Layout, num_kv_heads: int) -> torch.Tensor:
    """int64 [sum of B_k * H_kv * W_k]: each bucket's [B_k, H_kv, W_k] source rows, one bucket after the other.
    Past a sequence's length a row repeats its last key (masked out by the caller): real KV, where an unwritten
    slot could hold NaN, which a zero softmax weight would not cancel."""
    heads = torch.arange(num_kv_heads) * layout.head_stride                                              # [H_kv]
    parts = []
    for members, width in zip(buckets.members, buckets.widths):
        last = torch.tensor([lengths[b] for b in members])[:, None] - 1                                  # [B_k, 1]
        steps = torch.minimum(torch.arange(width)[None, :], last)                                        # [B_k, W]
        positions = torch.tensor([layout.firsts[b] for b in members])[:, None] + steps                  # [B_k, W]
        parts.append((positions[:, None, :] * layout.position_stride + heads[None, :, None]).reshape(-1))
    return torch.cat(parts)


def _bucket_padding(buckets: _Buckets, lengths: tuple[int, ...]) -> torch.Tensor:
    """bool [sum of B_k * W_k]: each bucket's [B_k, W_k] mask, True past a sequence's own length."""
    return torch.cat([(torch.arange(width)[None, :] >= torch.tensor([lengths[b] for b in members])[:, None])
                      .reshape(-1) for members, width in zip(buckets.members, buckets.widths)])
