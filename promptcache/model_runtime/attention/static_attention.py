"""Attention of a graph-captured step (engine/static_step.py): one call a layer over the step's static tables.
On a GPU with Triton in bf16/fp16 it is the shared-prefix kernel (`promptcache::shared_prefix_attention`); elsewhere
`promptcache::static_attention_reference`, an eager torch op with the kernel's semantics, so the CPU tests run the
same forward, the same tables and one op a layer (it attends over the whole pool under a mask: tests only)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from promptcache.model_runtime.attention.shared_prefix import kernel_serves


@dataclass(frozen=True, slots=True, eq=False)
class StaticTables:
    """A step's attention inputs; the tensors are the static buffers' views (tables: attention/triton_shared.py).
    `segment_keys`/`segment_values`: the shared segments' KV for the reference op (the kernel reads the addresses in
    `segment_table`); `num_chunks` and `max_query_len` are fixed per captured graph."""

    pool_keys: torch.Tensor      # [L, H_kv, slots, D]
    pool_values: torch.Tensor    # [L, H_kv, slots, D]
    seq_table: torch.Tensor      # int32 [B, 4]: query start, T_b, first pool slot, own length (the T_b included)
    token_table: torch.Tensor    # int32 [Q, 2]: each row's sequence and its index within it
    segment_table: torch.Tensor  # int64 [S, 9]: k and v addresses, length, (layer, head, token) strides of k and v
    segment_rows: torch.Tensor   # int32 [S, B]: first index t of sequence b that sees segment s (NOT_SEEN: none)
    segment_keys: tuple[torch.Tensor, ...]    # S x [L, H_kv, n_s, D] (empty where the kernel serves)
    segment_values: tuple[torch.Tensor, ...]
    num_chunks: int
    max_query_len: int
    use_kernel: bool


def uses_kernel(backend: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a static step on `device` in `dtype` attends through the Triton kernel (else the reference op)."""
    return kernel_serves(backend, device, dtype)


def attend(queries: torch.Tensor, layer: int, scale: float, tables: StaticTables) -> torch.Tensor:
    """queries [Q, H, D] of layer `layer` -> out [Q, H, D] in their dtype: one op, no host sync."""
    if tables.use_kernel:
        out, _ = torch.ops.promptcache.shared_prefix_attention(
            queries, tables.pool_keys, tables.pool_values, tables.seq_table, tables.token_table, tables.segment_table,
            tables.segment_rows, layer, scale, tables.num_chunks, tables.max_query_len)
        return out
    out, _ = static_attention_reference(queries, tables.pool_keys, tables.pool_values, tables.seq_table,
                                        tables.token_table, tables.segment_rows, list(tables.segment_keys),
                                        list(tables.segment_values), layer, scale)
    return out


@torch.library.custom_op("promptcache::static_attention_reference", mutates_args=())
def static_attention_reference(queries: torch.Tensor, pool_keys: torch.Tensor, pool_values: torch.Tensor,
                               seq_table: torch.Tensor, token_table: torch.Tensor, segment_rows: torch.Tensor,
                               segment_keys: list[torch.Tensor], segment_values: list[torch.Tensor], layer: int,
                               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's semantics in torch ops of fixed shapes (no host sync): out [Q, H, D], natural-log lse [Q, H]
    fp32; a row that sees no key gets out 0 and lse -inf."""
    return reference_attention(queries, pool_keys, pool_values, seq_table, token_table, segment_rows,
                               segment_keys, segment_values, layer, scale)


@static_attention_reference.register_fake
def _(queries: torch.Tensor, pool_keys: torch.Tensor, pool_values: torch.Tensor, seq_table: torch.Tensor,
      token_table: torch.Tensor, segment_rows: torch.Tensor, segment_keys: list[torch.Tensor],
      segment_values: list[torch.Tensor], layer: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (queries.new_empty(queries.shape),                                               # [Q, H, D]
            queries.new_empty(queries.shape[:2], dtype=torch.float32))                      # [Q, H]


def reference_attention(queries: torch.Tensor, pool_keys: torch.Tensor, pool_values: torch.Tensor,
                        seq_table: torch.Tensor, token_table: torch.Tensor, segment_rows: torch.Tensor,
                        segment_keys: list[torch.Tensor], segment_values: list[torch.Tensor], layer: int,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`static_attention_reference`'s body (callable outside the op, e.g. on the meta device)."""
    num_rows, num_heads, head_dim = queries.shape
    num_kv_heads, num_slots = pool_keys.shape[1], pool_keys.shape[2]
    group = num_heads // num_kv_heads
    seq = token_table[:, 0].long()                                            # [Q]
    t = token_table[:, 1].long()                                              # [Q]
    row_seq = seq_table.long()[seq]                                           # [Q, 4]
    q_len, first, length = row_seq[:, 1], row_seq[:, 2], row_seq[:, 3]
    # Own KV is slots first .. first + length - 1, its last q_len keys this step's tokens: query t sees own keys
    # 0 .. length - q_len + t (bottom-right causal), i.e. pool slots [first, first + length - q_len + t].
    slots = torch.arange(num_slots, device=queries.device)                   # [slots]
    own_visible = (slots[None, :] >= first[:, None]) & (slots[None, :] <= (first + length - q_len + t)[:, None])
    keys, values, visible = [pool_keys[layer]], [pool_values[layer]], [own_visible]  # [H_kv, n, D], [Q, n]
    for s, (seg_k, seg_v) in enumerate(zip(segment_keys, segment_values)):
        keys.append(seg_k[layer])
        values.append(seg_v[layer])
        # A segment is seen by a member's queries from its row offset on (NOT_SEEN: never).
        sees = t >= segment_rows[s].long()[seq]                               # [Q]
        visible.append(sees[:, None].expand(num_rows, seg_k.shape[2]))
    k = torch.cat(keys, dim=1).float()                                        # [H_kv, N, D]
    v = torch.cat(values, dim=1).float()                                      # [H_kv, N, D]
    mask = torch.cat(visible, dim=1)                                          # [Q, N]
    # GQA: fold the group into rows, q [Q, H, D] -> [H_kv, Q * G, D] (row = token * G + g)
    q = queries.float().view(num_rows, num_kv_heads, group, head_dim).permute(1, 0, 2, 3)
    q = q.reshape(num_kv_heads, num_rows * group, head_dim)
    scores = torch.bmm(q, k.transpose(1, 2)) * scale                         # [H_kv, Q * G, N]
    scores = scores.masked_fill(~mask.repeat_interleave(group, dim=0)[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                     # [H_kv, Q * G]
    weights = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])  # 0 where nothing is seen
    out = torch.bmm(weights, v)                                               # [H_kv, Q * G, D]
    out = out.view(num_kv_heads, num_rows, group, head_dim).permute(1, 0, 2, 3).reshape(num_rows, num_heads, head_dim)
    lse = lse.view(num_kv_heads, num_rows, group).permute(1, 0, 2).reshape(num_rows, num_heads)
    return out.to(queries.dtype), lse
