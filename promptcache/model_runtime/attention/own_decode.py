"""Decoding sequences' own KV: one padded, masked batch call for short KV (gathered from the pool where it lies),
one fused CPU call each for long KV."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

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
    own KV, copying it into a padded batch costs more than the calls. Returns out [B, H, D], lse [B, H]."""
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
               indices: StepIndices, pool: OwnPool | None = None):
    """One batched call for single-token sequences (query rows `rows`; None: all, in order) with short own KV padded
    and masked: gathered from `pool` by one index_select each, else copied. Returns out [B, H, D], lse [B, H] fp32."""
    lengths = tuple(k.shape[1] for k in own_keys)
    longest, batch, head_dim = max(lengths), len(lengths), queries.shape[-1]
    if pool is not None:
        keys, values = _gather(pool, lengths, indices)                     # [B, H_kv, S_max, D]
    else:
        keys = queries.new_zeros((batch, num_kv_heads, longest, head_dim))  # [B, H_kv, S_max, D]
        values = queries.new_zeros((batch, num_kv_heads, longest, head_dim))
        for b, (k, v) in enumerate(zip(own_keys, own_values)):
            keys[b, :, : k.shape[1]] = k
            values[b, :, : v.shape[1]] = v
    q = (queries if rows is None else queries[rows]).view(batch, num_kv_heads, group, head_dim)  # [B, H_kv, G, D]
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale           # [B, H_kv, G, S_max]
    padding = indices.get(("own_padding", lengths), lambda: torch.arange(longest)[None, :]
                          >= torch.tensor(lengths)[:, None])                            # [B, S_max] bool
    scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                                # [B, H_kv, G]
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), values.float())           # [B, H_kv, G, D]
    return out.reshape(batch, -1, head_dim), lse.reshape(batch, -1)                     # [B, H, D], [B, H]


def _gather(pool: OwnPool, lengths: tuple[int, ...], indices: StepIndices) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [B, H_kv, S_max, D] of the sequences' own KV, read from the pool's [H_kv * num_slots, D]
    rows by one index (the same for keys, values and every layer)."""
    num_kv_heads, num_slots, head_dim = pool.keys.shape
    longest = max(lengths)

    def build() -> torch.Tensor:
        # Row of key j of KV head h of sequence b: h * num_slots + first_slots[b] + j. Past a sequence's
        # length it repeats its last key (masked out by the caller): real KV, where an unwritten slot
        # could hold NaN, which a zero softmax weight would not cancel.
        steps = torch.minimum(torch.arange(longest)[None, :], torch.tensor(lengths)[:, None] - 1)   # [B, S_max]
        slots = torch.tensor(pool.first_slots)[:, None] + steps                                      # [B, S_max]
        return (torch.arange(num_kv_heads)[None, :, None] * num_slots + slots[:, None, :]).reshape(-1)

    flat = indices.get(("own_gather", pool.first_slots, lengths, num_slots), build)  # [B * H_kv * S_max]
    shape = (len(lengths), num_kv_heads, longest, head_dim)
    return (pool.keys.view(-1, head_dim).index_select(0, flat).view(shape),
            pool.values.view(-1, head_dim).index_select(0, flat).view(shape))
