"""The batch-invariant kernels (model_runtime/deterministic/csrc/) against plain fp64 math, and bit for bit against
themselves however a row's step is composed: any number of rows (1..33), the row at any place, other rows around it;
attention over one key segment or several, cached or own, alone or beside other sequences.

Oracles: fp64 `x @ W^T + b`, RMSNorm, SiLU gate and masked softmax attention (within tolerance), and the kernel's
own result for the row computed alone (exactly). Skipped with the reason where the library cannot be built."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from promptcache.model_runtime import deterministic
from promptcache.model_runtime.attention import kernel_build

DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # relative to the largest reference value


@pytest.fixture(scope="module")
def det(deterministic_kernels):
    return deterministic.prepare()


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = want.abs().max().item() + 1e-30
    error = (got.double() - want).abs().max().item()
    assert error <= TOLERANCE[dtype] * scale, f"max error {error} vs max |reference| {scale}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(37, 13), (100, 64), (576, 576), (33, 1536)])
def test_linear_matches_fp64(det, dtype, n, k):
    generator = torch.Generator().manual_seed(n * k)
    w, b = torch.randn(n, k, generator=generator).to(dtype), torch.randn(n, generator=generator).to(dtype)
    x = torch.randn(9, k, generator=generator).to(dtype)
    got = det.linear(x, det.pack(w), n, b)
    assert got.dtype == dtype and got.shape == (9, n)
    _close(got, x.double() @ w.double().T + b.double(), dtype)
    _close(det.linear(x, det.pack(w), n), x.double() @ w.double().T, dtype)  # no bias


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_row_is_the_same_bits_for_any_number_of_rows(det, dtype):
    generator = torch.Generator().manual_seed(1)
    n, k = 200, 96
    packed, bias = det.pack(torch.randn(n, k, generator=generator).to(dtype)), torch.randn(n).to(dtype)
    x = torch.randn(33, k, generator=generator).to(dtype)
    alone = torch.stack([det.linear(x[r: r + 1], packed, n, bias)[0] for r in range(33)])
    for rows in range(1, 34):
        assert torch.equal(det.linear(x[:rows], packed, n, bias), alone[:rows]), f"{rows} rows"
    for trial in range(20):  # the row at any place among other rows
        others = torch.randn(int(torch.randint(0, 32, (1,), generator=generator)), k, generator=generator).to(dtype)
        at = int(torch.randint(0, len(others) + 1, (1,), generator=generator))
        got = det.linear(torch.cat([others[:at], x[trial: trial + 1], others[at:]]), packed, n, bias)[at]
        assert torch.equal(got, alone[trial])


def test_linear_is_the_same_bits_for_any_thread_count(det):
    x, w = torch.randn(40, 128), torch.randn(300, 128)
    packed = det.pack(w)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(det.linear(x, packed, 300))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 100, 576])
def test_rms_norm_and_silu_gate_match_fp64_and_any_row_count(det, dtype, width):
    generator = torch.Generator().manual_seed(width)
    x = (torch.randn(33, width, generator=generator) * 3).to(dtype)
    weight = torch.randn(width, generator=generator).to(dtype)
    xd = x.double()
    _close(det.rms_norm(x, weight, 1e-5), weight.double() * xd * (xd.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt(),
           dtype)
    gate, up = xd[:, : width // 2], xd[:, width // 2: width // 2 * 2]
    _close(det.silu_mul(x[:, : width // 2 * 2].contiguous()), gate * torch.sigmoid(gate) * up, dtype)
    norm_alone = torch.cat([det.rms_norm(x[r: r + 1], weight, 1e-5) for r in range(33)])
    gate_alone = torch.cat([det.silu_mul(x[r: r + 1, : width // 2 * 2].contiguous()) for r in range(33)])
    for rows in (1, 2, 7, 16, 33):
        assert torch.equal(det.rms_norm(x[:rows], weight, 1e-5), norm_alone[:rows])
        assert torch.equal(det.silu_mul(x[:rows, : width // 2 * 2].contiguous()), gate_alone[:rows])


def _reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         visible: torch.Tensor) -> torch.Tensor:
    """fp64 softmax attention: q [T, H, D], keys/values [H_kv, N, D], visible [T, N] bool -> [T, H, D]."""
    group = q.shape[1] // keys.shape[0]
    k, v = keys.double().repeat_interleave(group, 0), values.double().repeat_interleave(group, 0)
    scores = torch.einsum("thd,hnd->htn", q.double(), k) / math.sqrt(q.shape[-1])
    return torch.einsum("htn,hnd->thd", scores.masked_fill(~visible[None], float("-inf")).softmax(-1), v)


def _plan(det, pieces, own, query_lens):
    """AttentionPlan over per-sequence pieces [(keys, values, first_row)] and own (keys, values, own_len)."""
    return det.AttentionPlan([[k for k, _, _ in p] for p in pieces], [[v for _, v, _ in p] for p in pieces],
                             [[f for _, _, f in p] for p in pieces], [k for k, _, _ in own], [v for _, v, _ in own],
                             [n for _, _, n in own], list(query_lens))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 16), (2, 2, 128), (6, 3, 24)])
def test_attention_matches_fp64_with_causal_own_keys_and_hidden_segments(det, dtype, heads, kv_heads, dim):
    generator = torch.Generator().manual_seed(dim)
    layers, cached, own_prefix, new = 2, 70, 11, 23

    def kv(n):  # [L, H_kv, n, D]
        return torch.randn(layers, kv_heads, n, dim, generator=generator).to(dtype)

    segment_k, segment_v, own_k, own_v = kv(cached), kv(cached), kv(own_prefix + new), kv(own_prefix + new)
    q = torch.randn(new, heads, dim, generator=generator).to(dtype)
    first_row = 5  # the segment is hidden from the first 5 query rows
    got = _plan(det, [[(segment_k, segment_v, first_row)]], [(own_k, own_v, own_prefix + new)],
                [new]).attend(q, 1, dim ** -0.5)
    visible = torch.zeros(new, cached + own_prefix + new, dtype=torch.bool)
    visible[first_row:, :cached] = True
    visible[:, cached:] = torch.ones(new, own_prefix + new, dtype=torch.bool).tril(own_prefix)
    keys, values = torch.cat([segment_k[1], own_k[1]], 1), torch.cat([segment_v[1], own_v[1]], 1)
    _close(got, _reference_attention(q, keys, values, visible), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_is_the_same_bits_however_the_keys_are_split(det, dtype):
    """One prefill over the prompt (all keys own), cached blocks + own tail (prefix reuse), a fork's prompt as a
    segment, a decode step: every query row sees the same keys in the same order and gets the same bits."""
    generator = torch.Generator().manual_seed(2)
    layers, kv_heads, heads, dim, total = 1, 3, 9, 64, 150
    keys = torch.randn(layers, kv_heads, total, dim, generator=generator).to(dtype)
    values = torch.randn(layers, kv_heads, total, dim, generator=generator).to(dtype)
    q = torch.randn(total, heads, dim, generator=generator).to(dtype)
    scale = dim ** -0.5
    cold = _plan(det, [[]], [(keys, values, total)], [total]).attend(q, 0, scale)
    for cuts in ([32], [5], [31, 64, 65], [8, 16, 24, 32, 40, 100], [149]):
        bounds = [0, *cuts]
        pieces = [(keys[:, :, a:b], values[:, :, a:b], 0) for a, b in itertools.pairwise(bounds)]
        last = cuts[-1]
        own = (keys[:, :, last:], values[:, :, last:], total - last)
        warm = _plan(det, [pieces], [own], [total - last])
        assert torch.equal(warm.attend(q[last:], 0, scale), cold[last:]), cuts
    for chunk in (1, 7, 64):  # a chunked prefill: earlier chunks' keys are own keys before the queries
        for start in range(0, total, chunk):
            end = min(total, start + chunk)
            got = _plan(det, [[]], [(keys, values, end)], [end - start]).attend(q[start:end], 0, scale)
            assert torch.equal(got, cold[start:end]), (chunk, start)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_row_is_the_same_bits_in_any_batch(det, dtype):
    """A decoding sequence over shared module KV and its own keys: alone, beside prefilling and decoding sequences
    that share the module, or that have other keys; the same bits, and each other sequence as it is alone."""
    generator = torch.Generator().manual_seed(3)
    layers, kv_heads, heads, dim = 2, 3, 9, 64

    def kv(n):
        return (torch.randn(layers, kv_heads, n, dim, generator=generator).to(dtype),
                torch.randn(layers, kv_heads, n, dim, generator=generator).to(dtype))

    module, doc, mine, theirs = kv(90), kv(40), kv(30), kv(50)
    seqs = [  # (pieces, own, query rows)
        ([(*module, 0)], (*mine, 30), 1),                  # decoding over the module
        ([(*module, 0), (*doc, 3)], (*theirs, 50), 20),    # prefilling 20 rows, the doc hidden from the first 3
        ([], (*theirs, 12), 12),                          # a plain prompt
        ([(*doc, 0), (*module, 0)], (*mine, 30), 1),       # other pieces, other order
    ]
    q = torch.randn(sum(n for *_, n in seqs), heads, dim, generator=generator).to(dtype)
    starts = [0]
    for *_, n in seqs:
        starts.append(starts[-1] + n)
    alone = [_plan(det, [p], [o], [n]).attend(q[a:b], 1, 0.125) for (p, o, n), a, b in zip(seqs, starts, starts[1:])]
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 0], [2, 0, 3]):
        chosen = [seqs[i] for i in order]
        rows = torch.cat([q[starts[i]: starts[i + 1]] for i in order])
        batched = _plan(det, [p for p, _, _ in chosen], [o for _, o, _ in chosen], [n for *_, n in chosen])
        out, first = batched.attend(rows, 1, 0.125), 0
        for i in order:
            n = seqs[i][2]
            assert torch.equal(out[first: first + n], alone[i]), (order, i)
            first += n


def test_library_name_carries_its_own_sources(tmp_path):
    path = kernel_build.library_path(tmp_path, deterministic.LIBRARY)
    assert path.name.startswith("promptcache_det_") and path != kernel_build.library_path(tmp_path)
