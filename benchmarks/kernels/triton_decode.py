"""A prototype: a decode step's shared-module attention for one layer in two Triton kernels.

An experiment for `gpu_attention.py` (mode `triton`), not the engine's path. On an H200 the engine's
eager call (`shared_module_attention`) costs 46 launches a layer and loses to one per-sequence SDPA
kernel 0.08x (docs/benchmarks.md): this measures what the same arithmetic costs in two launches.

    shared_partials  grid (H_kv, row blocks, key chunks): every sequence's query rows of one KV head (the
                     GQA group folded into rows) against one chunk of the shared keys, the shared KV read
                     once for all B sequences; partial out (fp32) and log-sum-exp per chunk.
    own_and_merge    grid (B, H_kv): the G query rows of one sequence against its own KV in the pool
                     (slots first[b] .. first[b] + length[b]), then merged with every shared chunk's
                     partial by log-sum-exp (Hydragen eq. 5); the output in q's dtype.

Layouts: q [B, H, D]; shared k/v [H_kv, P, D]; pool k/v [H_kv, slots, D]; first/length int32 [B].
Runs on CPU tensors too with TRITON_INTERPRET=1 (tests/benchmarks/test_triton_decode.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 64  # query rows (sequence x group) per shared program
BLOCK_KEYS = 64  # keys per inner step
MIN_OWN_ROWS = 16  # tl.dot needs 16 rows: a sequence's G rows are padded up to it


@triton.jit
def _online_block(q, k, v, key_ok, scale, top, total, acc):
    """One block of keys into a running softmax: q [rows, D], k/v [keys, D] (`key_ok` masks keys); top,
    total [rows] and acc [rows, D] (fp32) are the running max, sum of weights and weighted values."""
    scores = tl.dot(q, tl.trans(k)) * scale                                # [rows, keys] fp32
    scores = tl.where(key_ok[None, :], scores, float("-inf"))
    new_top = tl.maximum(top, tl.max(scores, 1))
    safe = tl.where(new_top == float("-inf"), 0.0, new_top)  # a block with no key left: weights 0
    rescale = tl.exp(top - safe)
    probs = tl.exp(scores - safe[:, None])
    total = total * rescale + tl.sum(probs, 1)
    acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v)
    return new_top, total, acc


@triton.jit
def _shared_partials(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, scale, num_rows, keys_per_chunk, num_keys,
                     group: tl.constexpr, num_heads: tl.constexpr, head_dim: tl.constexpr,
                     block_rows: tl.constexpr, block_keys: tl.constexpr):
    h = tl.program_id(0)
    row_block = tl.program_id(1)
    chunk = tl.program_id(2)
    rows = row_block * block_rows + tl.arange(0, block_rows)            # row = b * G + g
    dims = tl.arange(0, head_dim)
    row_ok = rows < num_rows
    # q [B, H, D]: row b * G + g of KV head h is query head h * G + g of sequence b
    q_offsets = (rows // group) * num_heads * head_dim + (h * group + rows % group) * head_dim
    q = tl.load(q_ptr + q_offsets[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
    top = tl.full([block_rows], float("-inf"), tl.float32)
    total = tl.zeros([block_rows], tl.float32)
    acc = tl.zeros([block_rows, head_dim], tl.float32)
    first = chunk * keys_per_chunk
    for start in range(0, keys_per_chunk, block_keys):
        keys = first + start + tl.arange(0, block_keys)
        key_ok = (keys < num_keys) & (keys < first + keys_per_chunk)
        kv_offsets = h * num_keys * head_dim + keys[:, None] * head_dim + dims[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptr + kv_offsets, mask=key_ok[:, None], other=0.0)
        top, total, acc = _online_block(q, k, v, key_ok, scale, top, total, acc)
    # partials [chunks, H_kv, rows, D] and [chunks, H_kv, rows]
    base = (chunk * tl.num_programs(0) + h) * num_rows
    # A chunk past the last key (none left for it) stores zeros and lse -inf: it weighs nothing.
    tl.store(out_ptr + (base + rows)[:, None] * head_dim + dims[None, :],
             acc / tl.where(total > 0, total, 1.0)[:, None], mask=row_ok[:, None])
    tl.store(lse_ptr + base + rows, top + tl.log(total), mask=row_ok)


@triton.jit
def _own_and_merge(q_ptr, k_ptr, v_ptr, first_ptr, length_ptr, shared_out_ptr, shared_lse_ptr, out_ptr, scale,
                   num_slots, num_rows, num_chunks, group: tl.constexpr, num_heads: tl.constexpr,
                   num_kv_heads: tl.constexpr, head_dim: tl.constexpr, block_rows: tl.constexpr,
                   block_keys: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, block_rows)
    g_ok = g < group
    dims = tl.arange(0, head_dim)
    q_offsets = b * num_heads * head_dim + (h * group + g) * head_dim
    q = tl.load(q_ptr + q_offsets[:, None] + dims[None, :], mask=g_ok[:, None], other=0.0)
    first = tl.load(first_ptr + b)
    length = tl.load(length_ptr + b)
    top = tl.full([block_rows], float("-inf"), tl.float32)
    total = tl.zeros([block_rows], tl.float32)
    acc = tl.zeros([block_rows, head_dim], tl.float32)
    for start in range(0, length, block_keys):
        keys = start + tl.arange(0, block_keys)
        key_ok = keys < length
        kv_offsets = h * num_slots * head_dim + (first + keys)[:, None] * head_dim + dims[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptr + kv_offsets, mask=key_ok[:, None], other=0.0)
        top, total, acc = _online_block(q, k, v, key_ok, scale, top, total, acc)
    # The shared chunks' partials of this sequence's rows, merged in: each is (out, lse) over its keys.
    rows = b * group + g
    for chunk in range(0, num_chunks):
        base = (chunk * num_kv_heads + h) * num_rows
        part_lse = tl.load(shared_lse_ptr + base + rows, mask=g_ok, other=float("-inf"))
        part_out = tl.load(shared_out_ptr + (base + rows)[:, None] * head_dim + dims[None, :], mask=g_ok[:, None],
                           other=0.0)
        new_top = tl.maximum(top, part_lse)
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)
        rescale = tl.exp(top - safe)
        weight = tl.exp(part_lse - safe)
        acc = acc * rescale[:, None] + part_out * weight[:, None]
        total = total * rescale + weight
        top = new_top
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + q_offsets[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


def shared_decode_attention(q: torch.Tensor, shared_k: torch.Tensor, shared_v: torch.Tensor, pool_k: torch.Tensor,
                            pool_v: torch.Tensor, first: torch.Tensor, length: torch.Tensor, scale: float,
                            chunks: int) -> torch.Tensor:
    """q [B, H, D] (one decoding row per sequence) attends the shared k/v [H_kv, P, D], which every
    sequence sees, and its own KV in the pool [H_kv, slots, D] (`first`, `length` int32 [B]); the shared
    keys in `chunks` chunks (more programs for a GPU's SMs). Returns [B, H, D] in q's dtype."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_keys, _ = shared_k.shape
    group = num_heads // num_kv_heads
    num_rows = batch * group
    keys_per_chunk = -(-num_keys // chunks)
    partial_out = torch.empty((chunks, num_kv_heads, num_rows, head_dim), dtype=torch.float32, device=q.device)
    partial_lse = torch.empty((chunks, num_kv_heads, num_rows), dtype=torch.float32, device=q.device)
    _shared_partials[(num_kv_heads, triton.cdiv(num_rows, BLOCK_ROWS), chunks)](
        q, shared_k, shared_v, partial_out, partial_lse, scale, num_rows, keys_per_chunk, num_keys,
        group=group, num_heads=num_heads, head_dim=head_dim, block_rows=BLOCK_ROWS, block_keys=BLOCK_KEYS)
    out = torch.empty_like(q)
    _own_and_merge[(batch, num_kv_heads)](
        q, pool_k, pool_v, first, length, partial_out, partial_lse, out, scale, pool_k.shape[1], num_rows, chunks,
        group=group, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_rows=max(MIN_OWN_ROWS, triton.next_power_of_2(group)), block_keys=BLOCK_KEYS)
    return out
