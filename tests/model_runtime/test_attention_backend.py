"""The device-generic attention backend: its GPU branch run on the CPU (torch's CUDA ops replaced by
CPU twins that return what the real ops return, checked against their meta kernels) against plain
attention, split-K against one unsplit call, and the CUDA op calls on the meta device (shapes,
argument order, lse slicing; any host sync raises there)."""

from __future__ import annotations

import math

import pytest
import torch

from promptcache.model_runtime.attention import (
    SharedSegment,
    StepIndices,
    dispatch,
    shared_attention,
    shared_module_attention,
    split_keys,
    step_indices,
)
from promptcache.model_runtime.attention.backends import matmul_attend
from promptcache.model_runtime.attention.gpu_backends import aten_efficient_attend, aten_flash_attend
from promptcache.model_runtime.attention.lse_merge import merge_stacked
from tests.model_runtime.test_shared_attention import CASES, make_case

ATEN = torch.ops.aten
REAL_FLASH, REAL_EFFICIENT = ATEN._scaled_dot_product_flash_attention, ATEN._scaled_dot_product_efficient_attention
REAL_VARLEN = ATEN._flash_attention_forward
# Beyond test_shared_attention's CASES: empty segments, row offsets (rows before a segment), a
# sequence whose rows see no segment, GQA 3 and 6, a segment long enough to be split over its keys with
# a tail (2050 keys in 4 splits: 3 chunks of 513 keys and a tail call of 511), prefill next to decode,
# lone sequences.
EXTRA_CASES = {
    "empty_and_offsets": dict(num_heads=6, num_kv_heads=2, query_lens=[5, 1, 3], own_lens=[5, 4, 3],
                              segment_specs=[(0, [0, 1]), (40, [0, 2]), (12, [1]), (0, [2])],
                              row_offsets=[None, (2, 3), None, None]),
    "gqa6_split_tail": dict(num_heads=12, num_kv_heads=2, query_lens=[1, 1, 2, 1], own_lens=[3, 9, 2, 1],
                            segment_specs=[(2050, [0, 1, 2, 3]), (600, [1, 3])], row_offsets=[None, None]),
    "rows_before_every_segment": dict(num_heads=4, num_kv_heads=2, query_lens=[4, 1], own_lens=[6, 2],
                                      segment_specs=[(30, [0, 1])], row_offsets=[(4, 0)]),
    # A lone sequence: on a GPU its KV is concatenated for one call (unless a row offset hides a segment).
    "lone_prefill": dict(num_heads=8, num_kv_heads=2, query_lens=[6], own_lens=[10],
                         segment_specs=[(40, [0]), (0, [0]), (17, [0])], row_offsets=[None, None, None]),
    "lone_decode": dict(num_heads=8, num_kv_heads=2, query_lens=[1], own_lens=[4], segment_specs=[(30, [0])],
                        row_offsets=[None]),
    "lone_row_offset": dict(num_heads=4, num_kv_heads=2, query_lens=[4], own_lens=[6],
                            segment_specs=[(20, [0]), (9, [0])], row_offsets=[(2,), None]),
}


def _concatenated(spec: dict, offsets: list) -> bool:
    """Whether the GPU branch attends this case as one lone sequence's concatenated KV."""
    return len(spec["query_lens"]) == 1 and not any(any(rows) for rows in offsets if rows)


def make_extra(seed: int, dtype: torch.dtype, *, row_offsets, **spec):
    queries, lens, own_k, own_v, segments = make_case(seed, dtype=dtype, **spec)
    segments = [SharedSegment(s.keys, s.values, s.seq_indices, offsets) for s, offsets in zip(segments, row_offsets)]
    return queries, lens, own_k, own_v, segments


def offset_reference(queries, query_lens, own_keys, own_values, segments):
    """Plain attention per query row: a row sees a segment only from its sequence's row offset on."""
    outs, row = [], 0
    for i, n in enumerate(query_lens):
        for t in range(n):
            seen = [s for s in segments if i in s.seq_indices
                    and t >= (s.row_offsets[s.seq_indices.index(i)] if s.row_offsets else 0)]
            visible = own_keys[i].shape[1] - n + t + 1
            keys = torch.cat([s.keys for s in seen] + [own_keys[i][:, :visible]], dim=1).float()   # [H_kv, S, D]
            values = torch.cat([s.values for s in seen] + [own_values[i][:, :visible]], dim=1).float()
            group = queries.shape[1] // keys.shape[0]
            q = queries[row + t].float().view(keys.shape[0], group, -1)                             # [H_kv, G, D]
            probs = (q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
            outs.append((probs @ values).reshape(1, -1, q.shape[-1]))
        row += n
    return torch.cat(outs)


def _cpu_attention(q, k, v, scale, causal):
    """What the CUDA ops compute, on the CPU: out in q's dtype, natural-log lse in fp32."""
    m, n = q.shape[2], k.shape[2]
    mask = torch.ones(m, n, dtype=torch.bool).tril(n - m) if causal else None
    out, lse = matmul_attend(q, k, v, scale, mask)
    return out.to(q.dtype), lse


class CudaOpTwins:
    """CPU stand-ins for torch's CUDA attention ops with their schemas; every call is checked against the
    real op's meta kernel (output and lse shapes, the efficient op's 32-row lse padding) and recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, bool]] = []

    def flash(self, q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
        assert dropout_p == 0.0 and return_debug_mask is False and q.dtype in (torch.float16, torch.bfloat16)
        self._check_layout(q, k, v, is_causal)
        meta = REAL_FLASH(*(t.to("meta") for t in (q, k, v)), dropout_p, is_causal, return_debug_mask, scale=scale)
        out, lse = _cpu_attention(q, k, v, scale, is_causal)
        assert meta[0].shape == out.shape and meta[1].shape == lse.shape and meta[1].dtype == torch.float32
        self.calls.append(("flash", tuple(q.shape), is_causal))
        return (out, lse, *meta[2:])

    def varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale):
        """The varlen flash op: q [total_q, H, D], k/v [total_k, H_kv, D] packed by cumulative offsets."""
        assert dropout_p == 0.0 and return_debug_mask is False and q.dtype in (torch.float16, torch.bfloat16)
        assert cu_q.dtype == cu_k.dtype == torch.int32 and all(t.stride(-1) == 1 for t in (q, k, v))
        meta = REAL_VARLEN(*(t.to("meta") for t in (q, k, v, cu_q, cu_k)), max_q, max_k, dropout_p, is_causal,
                           return_debug_mask, scale=scale)
        outs, lses = [], []
        for b in range(cu_q.numel() - 1):
            rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            assert rows.stop - rows.start <= max_q and keys.stop - keys.start <= max_k
            group = q.shape[1] // k.shape[1]
            out, lse = _cpu_attention(q[rows].transpose(0, 1)[None], *(t[keys].transpose(0, 1).repeat_interleave(
                group, 0)[None] for t in (k, v)), scale, is_causal)  # [1, H, M, D], [1, H, M]
            outs.append(out[0].transpose(0, 1))
            lses.append(lse[0])
        out, lse = torch.cat(outs), torch.cat(lses, dim=1)  # [total_q, H, D], [H, total_q]
        assert meta[0].shape == out.shape and meta[1].shape == lse.shape and meta[1].dtype == torch.float32
        self.calls.append(("flash", tuple(q.shape), is_causal))
        return (out, lse, *meta[2:])

    def efficient(self, q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, *, scale):
        assert attn_bias is None and compute_log_sumexp is True and dropout_p == 0.0
        self._check_layout(q, k, v, is_causal)
        meta = REAL_EFFICIENT(*(t.to("meta") for t in (q, k, v)), None, True, dropout_p, is_causal, scale=scale)
        out, lse = _cpu_attention(q, k, v, scale, is_causal)
        padded = torch.full(meta[1].shape, float("nan"))  # rows past M are padding: NaN if anyone reads them
        padded[..., : lse.shape[-1]] = lse
        assert meta[1].shape[-1] % 32 == 0 and meta[1].shape[-1] >= lse.shape[-1]
        self.calls.append(("efficient", tuple(q.shape), is_causal))
        return (out, padded, *meta[2:])

    @staticmethod
    def _check_layout(q, k, v, is_causal):
        assert q.dim() == k.dim() == v.dim() == 4 and k.shape == v.shape       # [B, H, M, D], [B, H, N, D]
        assert q.shape[:2] == k.shape[:2] and q.shape[3] == k.shape[3] and k.shape[2] > 0
        assert all(t.stride(-1) == 1 for t in (q, k, v))
        assert not is_causal or q.shape[2] == k.shape[2]


@pytest.fixture
def gpu_branch_on_cpu(monkeypatch):
    """Runs the GPU branch on CPU tensors, torch's CUDA ops replaced by their CPU twins."""
    twins = CudaOpTwins()
    monkeypatch.setattr(dispatch, "GPU_DEVICE_TYPES", frozenset({"cpu"}))
    monkeypatch.setattr(ATEN, "_scaled_dot_product_flash_attention", twins.flash)
    monkeypatch.setattr(ATEN, "_scaled_dot_product_efficient_attention", twins.efficient)
    monkeypatch.setattr(ATEN, "_flash_attention_forward", twins.varlen)
    return twins


ALL_CASES = {**{name: (spec, [None] * len(spec["segment_specs"])) for name, spec in CASES.items()},
             **{name: ({k: v for k, v in spec.items() if k != "row_offsets"}, spec["row_offsets"])
                for name, spec in EXTRA_CASES.items()}}


@pytest.mark.parametrize("dtype, tolerance, op", [(torch.float32, 1e-5, "efficient"),
                                                  (torch.bfloat16, 3e-2, "flash"), (torch.float16, 5e-3, "flash")])
@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_gpu_branch_matches_plain_attention(gpu_branch_on_cpu, name, dtype, tolerance, op):
    spec, offsets = ALL_CASES[name]
    case = make_extra(11, dtype, row_offsets=offsets, **spec)
    expected = offset_reference(*case)
    got = shared_module_attention(*case).float()
    assert not torch.isnan(got).any()
    assert (got - expected).abs().max().item() <= tolerance
    if _concatenated(spec, offsets):  # one SDPA call over the concatenation: torch's own op, no twin
        assert not gpu_branch_on_cpu.calls
    else:
        assert gpu_branch_on_cpu.calls and {kind for kind, _, _ in gpu_branch_on_cpu.calls} == {op}
    assert (got - shared_module_attention(*case, backend="matmul").float()).abs().max().item() <= tolerance


def test_a_lone_sequence_past_the_copy_bound_attends_segments_where_they_lie(gpu_branch_on_cpu, monkeypatch):
    monkeypatch.setattr(shared_attention, "CONCATENATED_MAX_BYTES", 0)
    spec, offsets = ALL_CASES["lone_prefill"]
    case = make_extra(17, torch.float32, row_offsets=offsets, **spec)
    got = shared_module_attention(*case)
    assert gpu_branch_on_cpu.calls  # the segment-by-segment path: torch's ops, through their twins
    assert (got - offset_reference(*case)).abs().max().item() <= 1e-5


def test_a_row_that_sees_no_key_gets_zeros(gpu_branch_on_cpu):
    """Sequence 0 has no own KV yet and its one segment starts after its only row."""
    queries, lens, own_k, own_v, segments = make_case(16, num_heads=4, num_kv_heads=2, query_lens=[1, 1],
                                                      own_lens=[0, 2], segment_specs=[(20, [0, 1])])
    segments = [SharedSegment(segments[0].keys, segments[0].values, (0, 1), (1, 0))]
    got = shared_module_attention(queries, lens, own_k, own_v, segments)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    assert (got[1:] - offset_reference(queries[1:], [1], own_k[1:], own_v[1:],
                                       [SharedSegment(segments[0].keys, segments[0].values, (0,))])
            ).abs().max().item() <= 1e-5


def test_causal_blocks_use_the_fused_op_and_no_mask_cache(gpu_branch_on_cpu):
    shared_attention._causal_mask.cache_clear()
    case = make_extra(12, torch.bfloat16, row_offsets=[None], **ALL_CASES["prefill_fused_causal"][0])
    shared_module_attention(*case)
    causal = [shape for kind, shape, is_causal in gpu_branch_on_cpu.calls if is_causal]
    assert sorted(shape[2] for shape in causal) == [40, 200]  # each prefilling sequence's square, all heads
    assert all(shape[1] == 8 for shape in causal)                # GQA 4: own KV expanded to the 8 query heads
    assert shared_attention._causal_mask.cache_info().currsize == 0


def test_long_shared_segments_are_split_over_their_keys(gpu_branch_on_cpu):
    case = make_extra(13, torch.bfloat16, row_offsets=[None, None], **ALL_CASES["long_shared_fused"][0])
    shared_module_attention(*case)
    # 12 rows x G 4 = 48 rows per KV head: 2 thread blocks of 128 rows; 2048 keys -> 4 chunks of 512.
    assert ("flash", (4, 2, 48, 16), False) in gpu_branch_on_cpu.calls


@pytest.mark.parametrize("num_keys, splits", [(2048, 4), (2050, 4), (1000, 2), (4096, 16), (700, 3)])
def test_split_keys_equals_one_call(num_keys, splits):
    g = torch.Generator().manual_seed(num_keys)
    q = torch.randn(2, 24, 16, generator=g)
    storage = torch.randn(3, 2, num_keys + 7, 16, generator=g)  # a [layers, H_kv, capacity, D] buffer's view
    k, v = storage[1, :, :num_keys], storage[2, :, 3: num_keys + 3]
    whole, whole_lse = matmul_attend(q, k, v, 0.25)

    def attend4(q4, k4, v4, scale):
        assert k4.data_ptr() == k.data_ptr() or k4.shape[0] == 1  # chunks are views of the keys
        return matmul_attend(q4, k4, v4, scale)

    out, lse = split_keys.split_attend(attend4, q, k, v, 0.25, splits)
    assert (out - whole).abs().max().item() <= 1e-5 and (lse - whole_lse).abs().max().item() <= 1e-5


def test_merge_stacked_ignores_parts_without_keys():
    g = torch.Generator().manual_seed(3)
    outs, lses = torch.randn(3, 2, 5, 4, generator=g), torch.randn(3, 2, 5, generator=g)
    lses[1] = float("-inf")
    lses[:, 0, 0] = float("-inf")  # a row no part saw
    out, lse = merge_stacked(outs, lses)
    weights = torch.softmax(lses[[0, 2]], dim=0)
    expected = (weights.unsqueeze(-1) * outs[[0, 2]]).sum(0)
    assert torch.allclose(out[:, 1:], expected[:, 1:], atol=1e-6)
    assert torch.allclose(lse[:, 1:], torch.logsumexp(lses, dim=0)[:, 1:], atol=1e-6)
    assert torch.isneginf(lse[0, 0]) and not torch.isnan(out).any()


def test_split_count():
    assert split_keys.num_splits(8, 8192, 132) == 16     # B = 32 x G 8 rows over 4 KV heads: 8 blocks
    assert split_keys.num_splits(200, 8192, 132) == 1    # one call fills the GPU
    assert split_keys.num_splits(8, 1000, 132) == 1      # too few keys to split
    assert split_keys.num_splits(40, 8192, 132) == 4     # ceil(132 / 40) = 4 chunks


@pytest.fixture
def gpu_branch_on_meta(monkeypatch):
    monkeypatch.setattr(dispatch, "GPU_DEVICE_TYPES", frozenset({"cuda", "meta"}))


def _on_meta(case):
    queries, lens, own_k, own_v, segments = case
    move = lambda t: t.to("meta")  # noqa: E731
    return (move(queries), lens, [move(k) for k in own_k], [move(v) for v in own_v],
            [SharedSegment(move(s.keys), move(s.values), s.seq_indices, s.row_offsets) for s in segments])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_cuda_op_calls_run_on_the_meta_device(gpu_branch_on_meta, name, dtype):
    """The real ops' meta kernels: shapes and argument order must fit, and no host sync may happen."""
    spec, offsets = ALL_CASES[name]
    queries, lens, own_k, own_v, segments = _on_meta(make_extra(14, dtype, row_offsets=offsets, **spec))
    got = shared_module_attention(queries, lens, own_k, own_v, segments)
    assert got.device.type == "meta" and got.shape == queries.shape and got.dtype == dtype


def test_meta_op_wrappers_return_row_aligned_lse():
    q = torch.empty(2, 4, 37, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 4, 100, 64, device="meta", dtype=torch.bfloat16)
    out, lse = aten_flash_attend(q, k, k, 0.125)
    assert out.shape == q.shape and lse.shape == (2, 4, 37) and lse.dtype == torch.float32
    out, lse = aten_efficient_attend(q.float(), k.float(), k.float(), 0.125)
    assert out.shape == q.shape and lse.shape == (2, 4, 37)  # sliced from 64 padded rows
    out, lse = aten_efficient_attend(q.float(), q.float(), q.float(), 0.125, causal=True)
    assert lse.shape == (2, 4, 37)


def test_index_tensors_are_built_once_per_forward_pass(gpu_branch_on_meta, monkeypatch):
    made = []
    real = step_indices.to_device
    monkeypatch.setattr(step_indices, "to_device", lambda host, device: made.append(host) or real(host, device))
    case = _on_meta(make_case(15, **CASES["gqa3_mixed"]))
    indices = StepIndices("meta")
    shared_module_attention(*case, indices=indices)
    first_layer = len(made)
    assert first_layer > 0
    shared_module_attention(*case, indices=indices)  # the next layer of the same pass
    assert len(made) == first_layer
