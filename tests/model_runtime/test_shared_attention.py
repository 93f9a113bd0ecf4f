"""Shared-module attention against plain attention over each sequence's concatenated KV."""

from __future__ import annotations

import math

import pytest
import torch

from promptcache.model_runtime.attention import (
    SharedSegment,
    backends,
    dispatch,
    merge_partials,
    shared_module_attention,
)
from promptcache.model_runtime.attention.backends import matmul_attend


def reference(queries, query_lens, own_keys, own_values, segments):
    """Plain attention: each sequence's KV = its segments + own KV (own attended bottom-right causally)."""
    outs, row = [], 0
    num_heads = queries.shape[1]
    for i, n in enumerate(query_lens):
        parts_k = [s.keys for s in segments if i in s.seq_indices] + [own_keys[i]]
        parts_v = [s.values for s in segments if i in s.seq_indices] + [own_values[i]]
        k, v = torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1)  # [H_kv, S, D]
        group = num_heads // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        q = queries[row: row + n].transpose(0, 1)  # [H, n, D]
        scores = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
        shared_len, own_len = k.shape[1] - own_keys[i].shape[1], own_keys[i].shape[1]
        cols = torch.arange(k.shape[1])
        limit = shared_len + own_len - n + torch.arange(n)
        scores = scores.masked_fill(cols[None, :] > limit[:, None], float("-inf"))
        outs.append((scores.softmax(-1) @ v.float()).transpose(0, 1))
        row += n
    return torch.cat(outs)


def make_case(seed, *, num_heads, num_kv_heads, query_lens, own_lens, segment_specs, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    d = 16

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    queries = r(sum(query_lens), num_heads, d)
    own_k = [r(num_kv_heads, n, d) for n in own_lens]
    own_v = [r(num_kv_heads, n, d) for n in own_lens]
    segments = [SharedSegment(r(num_kv_heads, length, d), r(num_kv_heads, length, d), tuple(users))
                for length, users in segment_specs]
    return queries, query_lens, own_k, own_v, segments


CASES = {
    "mha_decode": dict(num_heads=4, num_kv_heads=4, query_lens=[1, 1, 1], own_lens=[3, 1, 7],
                       segment_specs=[(40, [0, 1, 2]), (9, [1]), (25, [0, 2])]),
    "gqa3_mixed": dict(num_heads=6, num_kv_heads=2, query_lens=[1, 4, 1, 2], own_lens=[5, 4, 1, 9],
                       segment_specs=[(64, [0, 1, 2, 3]), (30, [1, 3]), (7, [2]), (50, [0])]),
    "gqa4_no_segment_for_one": dict(num_heads=8, num_kv_heads=2, query_lens=[3, 1], own_lens=[3, 6],
                                    segment_specs=[(33, [1])]),
    "prefill_fused_causal": dict(num_heads=8, num_kv_heads=2, query_lens=[200, 1, 40], own_lens=[260, 3, 40],
                                 segment_specs=[(100, [0, 1]), (30, [2])]),
    "long_shared_fused": dict(num_heads=8, num_kv_heads=2, query_lens=[1] * 12, own_lens=list(range(1, 13)),
                              segment_specs=[(2048, list(range(12))), (512, list(range(0, 12, 2)))]),
    # decode with own KV on both sides of the in-place threshold (128 keys), next to a prefilling sequence
    "long_own_decode_mixed": dict(num_heads=14, num_kv_heads=2, query_lens=[1, 1, 1, 1, 3],
                                  own_lens=[2048, 128, 127, 1, 300], segment_specs=[(64, [0, 1, 2, 3, 4])]),
}


@pytest.mark.parametrize("backend", ["auto", "matmul", "fused_cpu"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_plain_attention(name, backend):
    case = make_case(1, **CASES[name])
    got = shared_module_attention(*case, backend=backend)
    assert (got - reference(*case)).abs().max().item() <= 1e-4


def test_empty_own_kv_and_empty_segment():
    queries, lens, own_k, own_v, segments = make_case(
        2, num_heads=4, num_kv_heads=2, query_lens=[1, 1], own_lens=[0, 2], segment_specs=[(20, [0, 1]), (0, [1])])
    got = shared_module_attention(queries, lens, own_k, own_v, segments, backend="fused_cpu")
    assert not torch.isnan(got).any()
    assert (got - reference(queries, lens, own_k, own_v, segments)).abs().max().item() <= 1e-4


def test_bf16_within_tolerance():
    case = make_case(3, dtype=torch.bfloat16, **CASES["gqa3_mixed"])
    got = shared_module_attention(*case).float()
    assert (got - reference(*case)).abs().max().item() <= 3e-2  # bf16 inputs keep ~3 significant digits


def test_merge_partials_is_the_lse_identity():
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(2, 5, 8, generator=g), torch.randn(2, 30, 8, generator=g), torch.randn(2, 30, 8, generator=g)
    whole, _ = matmul_attend(q, k, v, 0.3)
    a, la = matmul_attend(q, k[:, :11], v[:, :11], 0.3)
    b, lb = matmul_attend(q, k[:, 11:], v[:, 11:], 0.3)
    assert (merge_partials([a, b], [la, lb]) - whole).abs().max().item() <= 1e-5
    empty_out, empty_lse = torch.zeros_like(a), torch.full_like(la, float("-inf"))  # a part with no keys
    assert (merge_partials([whole, empty_out], [torch.logsumexp(q @ k.transpose(-1, -2) * 0.3, -1), empty_lse])
            - whole).abs().max().item() <= 1e-5


def test_each_segment_is_attended_once_and_not_copied(monkeypatch):
    calls = []

    def counting(kernel):
        def wrapped(q, k, v, scale, mask=None):
            calls.append(k.data_ptr())
            return kernel(q, k, v, scale, mask)
        return wrapped

    monkeypatch.setattr(dispatch, "fused_cpu_attend", counting(backends.fused_cpu_attend))
    monkeypatch.setattr(dispatch, "matmul_attend", counting(backends.matmul_attend))
    case = make_case(5, **CASES["long_shared_fused"])
    shared_module_attention(*case, backend="auto")
    assert calls == [s.keys.data_ptr() for s in case[4]]  # one call per segment, on the original storage


def test_long_own_kv_is_read_in_place_from_strided_buffers(monkeypatch):
    """As in the engine: own KV is a [H_kv, S, D] view of a [layers, H_kv, capacity, D] buffer."""
    g = torch.Generator().manual_seed(7)
    lens = [700, 129, 40]
    buffers = [torch.randn(3, 2, n + 50, 16, generator=g) for n in lens for _ in range(2)]
    own_k = [buffers[2 * i][1, :, :n] for i, n in enumerate(lens)]
    own_v = [buffers[2 * i + 1][1, :, :n] for i, n in enumerate(lens)]
    queries = torch.randn(3, 6, 16, generator=g)
    segments = [SharedSegment(torch.randn(2, 80, 16, generator=g), torch.randn(2, 80, 16, generator=g), (0, 1, 2))]
    expected = reference(queries, [1, 1, 1], own_k, own_v, segments)
    real, seen = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, []

    def spy(q, k, v, *args, **kwargs):  # records which storage the fused op read keys from
        seen.append(k.untyped_storage().data_ptr())
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", spy)
    got = shared_module_attention(queries, [1, 1, 1], own_k, own_v, segments, backend="auto")
    assert (got - expected).abs().max().item() <= 1e-4
    own_buffers = {b.data_ptr() for b in buffers}
    # the two long sequences' keys were read where they lie; the short one went through the padded batch
    assert {p for p in seen if p in own_buffers} == {buffers[0].data_ptr(), buffers[2].data_ptr()}


def test_dispatch_thresholds():
    small = dispatch.choose("auto", torch.zeros(2, 1, 8), torch.zeros(2, 8, 8))
    large = dispatch.choose("auto", torch.zeros(2, 64, 8), torch.zeros(2, 4096, 8))
    assert small is backends.matmul_attend and large is backends.fused_cpu_attend
    with pytest.raises(ValueError):
        dispatch.choose("nope", torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))
    q = torch.zeros(1, 4, 8)
    assert dispatch.decode_in_place("auto", q, 128) and not dispatch.decode_in_place("auto", q, 127)
    assert not dispatch.decode_in_place("matmul", q, 4096)


def test_input_validation():
    queries, lens, own_k, own_v, segments = make_case(6, **CASES["mha_decode"])
    with pytest.raises(ValueError, match="sum to"):
        shared_module_attention(queries, [1, 1], own_k[:2], own_v[:2], segments)
    with pytest.raises(ValueError, match="out of range"):
        shared_module_attention(queries, lens, own_k, own_v,
                                [SharedSegment(segments[0].keys, segments[0].values, (5,))])
