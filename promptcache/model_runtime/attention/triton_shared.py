"""Shared-prefix attention of one layer in two Triton kernels, registered as the custom op
`promptcache::shared_prefix_attention` (a fake implementation too, so a CUDA graph or a trace can hold it).
Imports triton: load it only through `shared_prefix.load_kernel` (CUDA, or Triton's interpreter in tests).

    _shared_partials  grid (H_kv, row blocks, segments x key chunks): the query rows of every sequence that
                      sees a segment (the GQA group folded into rows) against one chunk of its keys, read once
                      for all of them where they lie; partial out (fp32) and log-sum-exp per (segment, chunk).
    _own_and_merge    grid (B, H_kv, row blocks of T_b x G): one sequence's rows against its own KV in the
                      pool (bottom-right causal), then every partial merged in by log-sum-exp (Hydragen eq. 5).

Tables (device tensors, built on the host once per pass: shared_prefix.py says how):
    seq_table     int32 [B, 4]    query start, query length T_b, first pool slot, own length (incl. the T_b)
    token_table   int32 [Q, 2]    the sequence of each query token and its index t within it
    segment_table int64 [S, 9]    k and v addresses, length, k's and v's (layer, head, token) strides
    segment_rows  int32 [S, B]    the first query index t of sequence b that sees segment s (>= T_b: none)
A layer with a sliding window W (`window` > 0) also takes the positions the prompt plan gave the tokens:
    query_positions int32 [Q]     each query token's position
    key_positions   int32 [P]     every sequence's own KV's positions (pool order), then every segment's keys'
    position_starts int32 [B + S] where sequence b's, then segment s's, positions start in key_positions
and a query at position q reads a key at k only if q - k < W; a key no row of a program reaches is not loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 64  # query rows (token x group) per shared program
BLOCK_KEYS = 64  # keys per inner step
MIN_DOT = 16  # tl.dot takes blocks of at least 16 along every dimension
SEGMENT_COLUMNS = 9
SEQ_COLUMNS = 4
# The position of a row outside the pass: above any real one, it never lowers a block's reach. A constexpr: compiled
# kernels read no other globals.
FAR = tl.constexpr(1 << 30)


@triton.jit
def _online_block(q, k, v, visible, scale, top, total, acc, precision: tl.constexpr, upcast: tl.constexpr):
    """One block of keys into a running softmax: q [rows, D], k/v [keys, D], `visible` [rows, keys]; top, total
    [rows] and acc [rows, D] (fp32) are the running max, sum of weights and weighted values. `upcast`: dots in
    fp32 (Triton 3.6's interpreter multiplies bf16 as raw integers)."""
    if upcast:
        q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=precision) * scale     # [rows, keys] fp32
    scores = tl.where(visible, scores, float("-inf"))
    new_top = tl.maximum(top, tl.max(scores, 1))
    safe = tl.where(new_top == float("-inf"), 0.0, new_top)  # a row with no key yet: weights 0
    rescale = tl.exp(top - safe)
    probs = tl.exp(scores - safe[:, None])
    total = total * rescale + tl.sum(probs, 1)
    acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=precision)
    return new_top, total, acc


@triton.jit
def _shared_partials(q_ptr, stride_qt, stride_qh, token_ptr, segment_ptr, segment_rows_ptr, part_out_ptr,
                     part_lse_ptr, kv_ptr, layer, scale, num_rows, num_seqs, num_chunks,
                     query_pos_ptr, key_pos_ptr, pos_start_ptr, window, windowed: tl.constexpr,
                     group: tl.constexpr, head_dim: tl.constexpr, block_d: tl.constexpr,
                     block_rows: tl.constexpr, block_keys: tl.constexpr, precision: tl.constexpr, upcast: tl.constexpr):
    h = tl.program_id(0)
    part = tl.program_id(2)  # = segment * num_chunks + chunk
    segment = part // num_chunks
    chunk = part % num_chunks
    rows = tl.program_id(1) * block_rows + tl.arange(0, block_rows)      # row = token * G + g
    dims = tl.arange(0, block_d)
    dim_ok = dims < head_dim
    row_in = rows < num_rows
    token = rows // group
    seq = tl.load(token_ptr + token * 2, mask=row_in, other=0)
    t = tl.load(token_ptr + token * 2 + 1, mask=row_in, other=0)
    first_row = tl.load(segment_rows_ptr + segment * num_seqs + seq, mask=row_in, other=0)
    row_ok = row_in & (t >= first_row)  # a member sequence's query from its row offset on
    q_offsets = token.to(tl.int64) * stride_qt + (h * group + rows % group) * stride_qh
    q = tl.load(q_ptr + q_offsets[:, None] + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if windowed:  # keys at positions <= reach are out of every row's window
        q_pos = tl.load(query_pos_ptr + token, mask=row_ok, other=FAR)
        reach = tl.min(q_pos, 0) - window
        segment_pos = key_pos_ptr + tl.load(pos_start_ptr + num_seqs + segment)

    # The segment's KV where it lies: addresses and strides from its table row (views need not be contiguous).
    entry = segment_ptr + segment * 9
    k_base = tl.load(entry).to(tl.pointer_type(kv_ptr.dtype.element_ty))
    v_base = tl.load(entry + 1).to(tl.pointer_type(kv_ptr.dtype.element_ty))
    length = tl.load(entry + 2)
    k_base += layer * tl.load(entry + 3) + h * tl.load(entry + 4)
    v_base += layer * tl.load(entry + 6) + h * tl.load(entry + 7)
    k_token, v_token = tl.load(entry + 5), tl.load(entry + 8)
    per_chunk = (length + num_chunks - 1) // num_chunks
    lo = chunk * per_chunk
    hi = tl.minimum(lo + per_chunk, length)
    hi = tl.where(tl.max(row_ok.to(tl.int32), 0) > 0, hi, lo)  # no row of this block sees it: read nothing

    top = tl.full([block_rows], float("-inf"), tl.float32)
    total = tl.zeros([block_rows], tl.float32)
    acc = tl.zeros([block_rows, block_d], tl.float32)
    for start in range(lo, hi, block_keys):
        keys = start + tl.arange(0, block_keys)
        key_ok = keys < hi
        visible = row_ok[:, None] & key_ok[None, :]
        if windowed:
            k_pos = tl.load(segment_pos + keys, mask=key_ok, other=0)
            key_ok = key_ok & (k_pos > reach)
            visible = visible & key_ok[None, :] & (q_pos[:, None] - k_pos[None, :] < window)
        load_ok = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_base + keys[:, None] * k_token + dims[None, :], mask=load_ok, other=0.0)
        v = tl.load(v_base + keys[:, None] * v_token + dims[None, :], mask=load_ok, other=0.0)
        top, total, acc = _online_block(q, k, v, visible, scale, top, total, acc, precision, upcast)
    # partials [parts, H_kv, rows, D] and [parts, H_kv, rows]; a row that saw no key: zeros and lse -inf.
    base = (part * tl.num_programs(0) + h).to(tl.int64) * num_rows + rows
    tl.store(part_out_ptr + base[:, None] * head_dim + dims[None, :],
             acc / tl.where(total > 0, total, 1.0)[:, None], mask=row_in[:, None] & dim_ok[None, :])
    tl.store(part_lse_ptr + base, top + tl.log(total), mask=row_in)


@triton.jit
def _own_and_merge(q_ptr, stride_qt, stride_qh, seq_ptr, pool_k_ptr, pool_v_ptr, stride_ph, stride_ps,
                   part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, scale, num_rows, num_parts,
                   query_pos_ptr, key_pos_ptr, pos_start_ptr, window, windowed: tl.constexpr,
                   group: tl.constexpr, num_heads: tl.constexpr, head_dim: tl.constexpr, block_d: tl.constexpr,
                   block_rows: tl.constexpr, block_keys: tl.constexpr, precision: tl.constexpr, upcast: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    local = tl.program_id(2) * block_rows + tl.arange(0, block_rows)    # local row = t * G + g
    t = local // group
    g = local % group
    dims = tl.arange(0, block_d)
    dim_ok = dims < head_dim
    q_start = tl.load(seq_ptr + b * 4)
    q_len = tl.load(seq_ptr + b * 4 + 1)
    first = tl.load(seq_ptr + b * 4 + 2).to(tl.int64)
    length = tl.load(seq_ptr + b * 4 + 3)
    row_ok = t < q_len
    token = (q_start + t).to(tl.int64)
    q_offsets = token * stride_qt + (h * group + g) * stride_qh
    q = tl.load(q_ptr + q_offsets[:, None] + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # Own KV is slots first .. first + length - 1; its last q_len keys are this step's tokens, so query t sees
    # keys 0 .. length - q_len + t (causal, bottom-right). Keys past the block's last visible one are not read.
    limit = tl.where(row_ok, length - q_len + t, -1)                    # [rows]
    end = tl.minimum(length, tl.max(limit, 0) + 1)
    kv_base = h.to(tl.int64) * stride_ph  # pool_k_ptr/pool_v_ptr: this layer's [H_kv, slots, D]
    if windowed:  # own keys at positions <= reach are out of every row's window
        q_pos = tl.load(query_pos_ptr + token, mask=row_ok, other=FAR)
        reach = tl.min(q_pos, 0) - window
        own_pos = key_pos_ptr + tl.load(pos_start_ptr + b)
    top = tl.full([block_rows], float("-inf"), tl.float32)
    total = tl.zeros([block_rows], tl.float32)
    acc = tl.zeros([block_rows, block_d], tl.float32)
    for start in range(0, end, block_keys):
        keys = start + tl.arange(0, block_keys)
        key_ok = keys < end
        visible = key_ok[None, :] & (keys[None, :] <= limit[:, None])
        if windowed:
            k_pos = tl.load(own_pos + keys, mask=key_ok, other=0)
            key_ok = key_ok & (k_pos > reach)
            visible = visible & key_ok[None, :] & (q_pos[:, None] - k_pos[None, :] < window)
        offsets = kv_base + (first + keys)[:, None] * stride_ps + dims[None, :]
        load_ok = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(pool_k_ptr + offsets, mask=load_ok, other=0.0)
        v = tl.load(pool_v_ptr + offsets, mask=load_ok, other=0.0)
        top, total, acc = _online_block(q, k, v, visible, scale, top, total, acc, precision, upcast)

    # Every (segment, chunk) partial of these rows merged in: each is (out, lse) over its keys, lse -inf if none.
    rows = token * group + g
    for part in range(0, num_parts):
        base = (part * tl.num_programs(1) + h).to(tl.int64) * num_rows + rows
        part_lse = tl.load(part_lse_ptr + base, mask=row_ok, other=float("-inf"))
        part_out = tl.load(part_out_ptr + base[:, None] * head_dim + dims[None, :],
                           mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        new_top = tl.maximum(top, part_lse)
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)
        rescale = tl.exp(top - safe)
        weight = tl.exp(part_lse - safe)
        acc = acc * rescale[:, None] + part_out * weight[:, None]
        total = total * rescale + weight
        top = new_top
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    heads = h * group + g
    tl.store(out_ptr + (token * num_heads + heads)[:, None] * head_dim + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(lse_ptr + token * num_heads + heads, top + tl.log(total), mask=row_ok)


@torch.library.custom_op("promptcache::shared_prefix_attention", mutates_args=())
def shared_prefix_attention(queries: torch.Tensor, pool_keys: torch.Tensor, pool_values: torch.Tensor,
                            seq_table: torch.Tensor, token_table: torch.Tensor, segment_table: torch.Tensor,
                            segment_rows: torch.Tensor, layer: int, scale: float, num_chunks: int,
                            max_query_len: int, window: int = 0, query_positions: torch.Tensor | None = None,
                            key_positions: torch.Tensor | None = None, position_starts: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """queries [Q, H, D] (the step's tokens, grouped by sequence; the last dim contiguous) attend, for
    layer `layer`, the shared segments of `segment_table` their sequences see and their own KV in the pool
    keys/values [L, H_kv, slots, D] (tables: the module docstring). Each segment's keys are cut into
    `num_chunks` chunks (programs for idle SMs); `max_query_len` is the largest T_b. `window` > 0: the layer's
    sliding window, over the three position tables (the module docstring). Returns out [Q, H, D]
    in the queries' dtype and the natural-log lse [Q, H] fp32 (-inf, out 0, for a row that sees no key)."""
    num_tokens, num_heads, head_dim = queries.shape
    num_kv_heads = pool_keys.shape[1]
    group = num_heads // num_kv_heads
    num_rows, num_seqs, num_segments = num_tokens * group, seq_table.shape[0], segment_table.shape[0]
    num_parts = num_segments * num_chunks
    block_d = max(MIN_DOT, triton.next_power_of_2(head_dim))
    # On a CPU the kernels run in Triton's interpreter (tests): dots in fp32 there, exact (IEEE) as fp32 is here.
    upcast = queries.device.type == "cpu"
    precision = "ieee" if upcast or queries.dtype == torch.float32 else "tf32"  # fp32: no TF32 inside tl.dot
    stride_qt, stride_qh = queries.stride(0), queries.stride(1)
    windowed = window > 0
    if windowed:
        assert query_positions is not None and key_positions is not None and position_starts is not None, \
            "a windowed layer reads the pass's positions"
        positions = (query_positions, key_positions, position_starts, window)
    else:  # never read
        positions = (seq_table, seq_table, seq_table, 0)
    # partials [parts, H_kv, Q * G, D] fp32 and their lse [parts, H_kv, Q * G]
    part_out = torch.empty((max(num_parts, 1), num_kv_heads, num_rows, head_dim), dtype=torch.float32,
                           device=queries.device)
    part_lse = torch.empty((max(num_parts, 1), num_kv_heads, num_rows), dtype=torch.float32, device=queries.device)
    if num_parts and num_rows:
        _shared_partials[(num_kv_heads, triton.cdiv(num_rows, BLOCK_ROWS), num_parts)](
            queries, stride_qt, stride_qh, token_table, segment_table, segment_rows, part_out, part_lse, pool_keys,
            layer, scale, num_rows, num_seqs, num_chunks, *positions, windowed=windowed, group=group,
            head_dim=head_dim, block_d=block_d, block_rows=BLOCK_ROWS, block_keys=BLOCK_KEYS, precision=precision,
            upcast=upcast)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=queries.dtype, device=queries.device)
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=queries.device)
    own_rows = max(MIN_DOT, min(BLOCK_ROWS, triton.next_power_of_2(max(1, max_query_len * group))))
    if num_seqs and max_query_len:
        layer_keys, layer_values = pool_keys[layer], pool_values[layer]  # [H_kv, slots, D] views
        _own_and_merge[(num_seqs, num_kv_heads, triton.cdiv(max_query_len * group, own_rows))](
            queries, stride_qt, stride_qh, seq_table, layer_keys, layer_values, layer_keys.stride(0),
            layer_keys.stride(1), part_out, part_lse, out, lse, scale, num_rows,
            num_parts, *positions, windowed=windowed, group=group, num_heads=num_heads, head_dim=head_dim,
            block_d=block_d, block_rows=own_rows, block_keys=BLOCK_KEYS, precision=precision, upcast=upcast)
    return out, lse


@shared_prefix_attention.register_fake
def _(queries: torch.Tensor, pool_keys: torch.Tensor, pool_values: torch.Tensor, seq_table: torch.Tensor,
      token_table: torch.Tensor, segment_table: torch.Tensor, segment_rows: torch.Tensor, layer: int, scale: float,
      num_chunks: int, max_query_len: int, window: int = 0, query_positions: torch.Tensor | None = None,
      key_positions: torch.Tensor | None = None, position_starts: torch.Tensor | None = None
      ) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, _ = queries.shape
    return (queries.new_empty(queries.shape),                                           # [Q, H, D]
            queries.new_empty((num_tokens, num_heads), dtype=torch.float32))            # [Q, H]
