"""Own-KV decode without padding to the longest: equal to plain attention for ragged lengths and GQA, from a pool
or from buffers of their own; intermediates sized by the sum of the lengths, not batch x longest; fp16/bf16 KV
read as it is, packed, on the GPU branch (meta device)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from promptcache.model_runtime.attention import OwnPool, StepIndices, dispatch
from promptcache.model_runtime.attention.own_decode import own_decode

HEAD_DIM = 16


def plain_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float):
    """q [H, D] over keys/values [H_kv, S, D] (GQA by repetition), fp32: out [H, D], lse [H]."""
    group = q.shape[0] // keys.shape[0]
    k, v = keys.float().repeat_interleave(group, 0), values.float().repeat_interleave(group, 0)  # [H, S, D]
    scores = torch.einsum("hd,hsd->hs", q.float(), k) * scale                                  # [H, S]
    return torch.einsum("hs,hsd->hd", scores.softmax(-1), v), torch.logsumexp(scores, -1)


def make_pool(lengths, num_kv_heads, seed=0, dtype=torch.float32):
    """A pool whose unwritten slots hold NaN, sequences' slots apart and out of order; their KV as views."""
    g = torch.Generator().manual_seed(seed)
    num_slots = sum(lengths) + 64 * len(lengths)
    pool_k = torch.full((num_kv_heads, num_slots, HEAD_DIM), float("nan"), dtype=dtype)  # [H_kv, slots, D]
    pool_v = pool_k.clone()
    firsts = [num_slots - sum(lengths[: b + 1]) - 7 * b for b in range(len(lengths))]  # descending, gaps between
    for first, n in zip(firsts, lengths):
        pool_k[:, first: first + n] = torch.randn(num_kv_heads, n, HEAD_DIM, generator=g).to(dtype)
        pool_v[:, first: first + n] = torch.randn(num_kv_heads, n, HEAD_DIM, generator=g).to(dtype)
    own_k = [pool_k[:, f: f + n] for f, n in zip(firsts, lengths)]
    own_v = [pool_v[:, f: f + n] for f, n in zip(firsts, lengths)]
    return OwnPool(pool_k, pool_v, tuple(firsts)), own_k, own_v


@pytest.mark.parametrize("pooled", [True, False], ids=["pool", "own_buffers"])
@pytest.mark.parametrize("lengths,num_heads,num_kv_heads", [
    ((1, 5, 300), 14, 2), ((300, 1, 5, 2, 64), 8, 8), ((7,), 6, 3), ((1, 1, 1), 4, 1)])
def test_ragged_lengths_match_plain_attention(lengths, num_heads, num_kv_heads, pooled):
    pool, own_k, own_v = make_pool(lengths, num_kv_heads)
    queries = torch.randn(len(lengths), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    scale = 1 / math.sqrt(HEAD_DIM)
    out, lse = own_decode(queries, None, own_k, own_v, num_kv_heads, num_heads // num_kv_heads, scale,
                          StepIndices("cpu"), pool if pooled else None)
    assert out.shape == queries.shape and lse.shape == queries.shape[:2]
    for b, (k, v) in enumerate(zip(own_k, own_v)):
        want_out, want_lse = plain_attention(queries[b], k, v, scale)
        assert (out[b] - want_out).abs().max().item() <= 1e-5
        assert (lse[b] - want_lse).abs().max().item() <= 1e-5


def test_query_rows_are_picked():
    pool, own_k, own_v = make_pool((3, 40), 2)
    queries = torch.randn(5, 4, HEAD_DIM)
    rows = torch.tensor([4, 1])
    out, _ = own_decode(queries, rows, own_k, own_v, 2, 2, 0.3, StepIndices("cpu"), pool)
    for b, row in enumerate(rows.tolist()):
        assert (out[b] - plain_attention(queries[row], own_k[b], own_v[b], 0.3)[0]).abs().max().item() <= 1e-5


class _Sizes(TorchDispatchMode):
    """Every tensor an op makes (views excluded): (op name, element count, dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, int, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.made.append((func.__name__, t.numel(), t.dtype))
        return out


def _made(lengths, num_heads=14, num_kv_heads=2) -> list[tuple[str, int, torch.dtype]]:
    """What one layer's call makes once the pass's index tables exist (they are built on the first layer)."""
    pool, own_k, own_v = make_pool(lengths, num_kv_heads)
    queries = torch.randn(len(lengths), num_heads, HEAD_DIM)
    indices = StepIndices("cpu")
    own_decode(queries, None, own_k, own_v, num_kv_heads, num_heads // num_kv_heads, 0.25, indices, pool)
    with _Sizes() as sizes:
        own_decode(queries, None, own_k, own_v, num_kv_heads, num_heads // num_kv_heads, 0.25, indices, pool)
    return sizes.made


def test_intermediates_scale_with_the_sum_of_lengths_not_batch_times_longest():
    """Padded to the longest, (1, 5, 300) would copy K and V as [3, H_kv, 300, D] (3x the keys there are) and
    63 one-token sequences next to one of 300 keys as [64, H_kv, 300, D] (53x);
    what is made instead is sized by the keys there are and by the query rows [B, H, D]."""
    kv_row = 2 * HEAD_DIM  # H_kv x D elements a key
    made = _made((1, 5, 300))  # each in a bucket of its own: no padding at all
    assert max(n for _, n, _ in made) == 306 * kv_row
    assert sum(n for _, n, _ in made) < 2 * 3 * 300 * kv_row  # everything made, less than the padded K and V
    assert sum(n for _, n, _ in _made((1,) * 63 + (300,))) < 2 * 64 * 300 * kv_row / 5
    lengths = tuple(torch.randint(1, 500, (40,), generator=torch.Generator().manual_seed(3)).tolist())
    gathered = [n for name, n, _ in _made(lengths) if name.startswith("index_select") and n % kv_row == 0
                and n >= sum(lengths) * kv_row // 2]  # the K and V gathers
    assert len(gathered) == 2 and all(n < 2 * sum(lengths) * kv_row for n in gathered)  # under 2x the keys


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_branch_reads_half_kv_as_it_is(dtype, monkeypatch):
    """On the GPU branch (meta standing in for CUDA: any host sync would raise) fp16/bf16 KV goes to the varlen
    flash op packed, in its dtype: no fp32 copy of it; out [B, H, D], lse [B, H] fp32."""
    monkeypatch.setattr(dispatch, "GPU_DEVICE_TYPES", frozenset({"cuda", "meta"}))
    lengths, num_kv_heads, num_heads, head_dim = (1, 5, 300), 2, 14, 64
    pool_k = torch.empty((num_kv_heads, 512, head_dim), dtype=dtype, device="meta")
    pool = OwnPool(pool_k, torch.empty_like(pool_k), (400, 0, 10))
    own_k = [pool_k[:, f: f + n] for f, n in zip(pool.first_slots, lengths)]
    queries = torch.empty((3, num_heads, head_dim), dtype=dtype, device="meta")
    with _Sizes() as seen:
        out, lse = own_decode(queries, None, own_k, own_k, num_kv_heads, 7, 0.125, StepIndices("meta"), pool)
    assert out.shape == (3, num_heads, head_dim) and out.dtype == dtype
    assert lse.shape == (3, num_heads) and lse.dtype == torch.float32
    assert "_flash_attention_forward.default" in {name for name, _, _ in seen.made}
    assert torch.float32 not in [d for _, n, d in seen.made if n >= 306 * num_kv_heads]
    assert max(n for _, n, _ in seen.made) == 306 * num_kv_heads * head_dim  # packed: no padding, no expansion


def test_cpu_bf16_keeps_fp32_math():
    pool, own_k, own_v = make_pool((2, 9, 130), 2, dtype=torch.bfloat16)
    queries = torch.randn(3, 4, HEAD_DIM).to(torch.bfloat16)
    out, lse = own_decode(queries, None, own_k, own_v, 2, 2, 0.25, StepIndices("cpu"), pool)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    for b in range(3):
        assert (out[b] - plain_attention(queries[b], own_k[b], own_v[b], 0.25)[0]).abs().max().item() <= 1e-5
