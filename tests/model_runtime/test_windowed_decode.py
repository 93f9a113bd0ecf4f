"""Decode steps through a sliding window on the fp32 decode kernel (WindowedPass.decode_parts -> DecodeBatch): what
each sequence's one query reaches (the suffix of every part past its position minus W) against float64 softmax
attention under the explicit mask, KV out of reach never read, and a tiny Gemma 3 with 256-wide heads generating past
its window as Hugging Face's forward does. Skipped on CPUs without AVX2/FMA/F16C."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime, avx2, wrap_model
from promptcache.model_runtime.attention.sliding_window import WindowedPass
from promptcache.model_runtime.engine import Fidelity
from tests.model_factories import make_test_tokenizer
from tests.model_runtime.batched_generation import assert_batched_generation_equals_hf
from tests.model_runtime.test_fidelity import PROMPTS, SCHEMA
from tests.model_runtime.test_gemma3 import make_tiny_gemma3

pytestmark = pytest.mark.usefixtures("avx2_kernels")

L = 2  # layers of the KV tensors; layer 1 holds other values (the batch must read the layer it is given)


def _decode_pass(window: int, heads: int, kv_heads: int, dim: int, *, poison: bool = False):
    """Three decoding sequences over discontinuous positions: segment A [0..99] shared by all (sequence 2 from row 1 on:
    hidden from its one row), B [200..299] by sequences 0 and 1, C [150..170] sequence 2's alone; own KV in buffers
    of capacity 64 (strided views), positions 300..309, 400..404 and 171..180, each query its last. Returns the pass,
    own KV (keys, values, lengths), queries [3, H, D] and float64 softmax attention under the explicit mask."""
    gen = torch.Generator().manual_seed(dim + heads)
    seg_pos = [torch.arange(0, 100), torch.arange(200, 300), torch.arange(150, 171)]
    members = [((0, 1, 2), (0, 0, 1)), ((0, 1), None), ((2,), None)]
    segments = [(torch.randn(L, kv_heads, p.numel(), dim, generator=gen),
                 torch.randn(L, kv_heads, p.numel(), dim, generator=gen), m, o) for p, (m, o) in zip(seg_pos, members)]
    own_pos = [torch.arange(300, 310), torch.arange(400, 405), torch.arange(171, 181)]
    own = [(torch.randn(L, kv_heads, 64, dim, generator=gen), torch.randn(L, kv_heads, 64, dim, generator=gen))
           for _ in own_pos]
    queries = torch.randn(3, heads, dim, generator=gen)
    expected = torch.empty_like(queries)
    for seq, positions in enumerate(own_pos):
        q_pos = positions[-1]
        keys, values, key_pos = [], [], []
        for (k, v, m, o), p in zip(segments, seg_pos):
            if seq in m and not (o and o[m.index(seq)] > 0):
                keys.append(k[0]), values.append(v[0]), key_pos.append(p)
        n = positions.numel()
        keys.append(own[seq][0][0, :, :n]), values.append(own[seq][1][0, :, :n]), key_pos.append(positions)
        seen = q_pos - torch.cat(key_pos) < window  # [m]
        k = torch.cat(keys, 1).double().repeat_interleave(heads // kv_heads, 0)[:, seen]  # [H, m', D]
        v = torch.cat(values, 1).double().repeat_interleave(heads // kv_heads, 0)[:, seen]
        scores = (queries[seq].double()[:, None, :] @ k.transpose(1, 2))[:, 0] * dim ** -0.5  # [H, m']
        expected[seq] = (scores.softmax(-1)[:, None, :] @ v)[:, 0].float()
    if poison:  # layer 0's KV at or before each reader's query position - window: NaN (a read would spread it)
        reach = [int(p[-1]) - window for p in own_pos]
        for (k, v, m, _), p in zip(segments, seg_pos):
            out = p <= min(reach[seq] for seq in m)
            k[0, :, out], v[0, :, out] = float("nan"), float("nan")
        for (k, v), p, low in zip(own, own_pos, reach):
            k[0, :, : p.numel()][:, p <= low], v[0, :, : p.numel()][:, p <= low] = float("nan"), float("nan")
    query_pos = [p[-1:] for p in own_pos]
    window_pass = WindowedPass((window, None), query_pos, own_pos, segments, seg_pos)
    own_kv = ([k for k, _ in own], [v for _, v in own], [p.numel() for p in own_pos])
    return window_pass, own_kv, queries, expected


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 1, 256), (8, 2, 64), (4, 4, 128)])
@pytest.mark.parametrize("window", [8, 128, 250])
def test_windowed_decode_batch_equals_masked_attention(window, heads, kv_heads, dim):
    window_pass, (keys, values, lens), queries, expected = _decode_pass(window, heads, kv_heads, dim)
    parts = window_pass.decode_parts(window, keys, values, lens)
    assert parts is not None
    batch = avx2.decode_batch_type()(parts.own_keys, parts.own_values, parts.own_lens, parts.segment_keys,
                                     parts.segment_values, parts.segment_members)
    got = batch.attend(queries, 0, dim ** -0.5)[0]
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)
    masked = window_pass.attend(queries, 0, lambda layer: ([k[layer, :, :n] for k, n in zip(keys, lens)],
                                                           [v[layer, :, :n] for v, n in zip(values, lens)]),
                                dim ** -0.5)
    torch.testing.assert_close(got, masked, rtol=2e-5, atol=2e-5)  # the path it replaces


def test_kv_out_of_reach_is_not_read_by_the_decode_batch():
    """Every key at or before its readers' query position - W set to NaN on layer 0: the output stays finite and equal
    (the suffix views start past them)."""
    window_pass, (keys, values, lens), queries, expected = _decode_pass(64, 4, 1, 256, poison=True)
    parts = window_pass.decode_parts(64, keys, values, lens)
    assert parts is not None and sum(k.shape[2] for k in parts.segment_keys) < 221  # not every segment key
    batch = avx2.decode_batch_type()(parts.own_keys, parts.own_values, parts.own_lens, parts.segment_keys,
                                     parts.segment_values, parts.segment_members)
    got = batch.attend(queries, 0, 256 ** -0.5)[0]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


def test_a_segment_out_of_position_order_is_read_in_runs():
    """Prefix blocks need not lie in position order: segment B's keys and values shuffled block-wise (with their
    positions) give the same output, each run of keys in reach one view."""
    window_pass, (keys, values, lens), queries, expected = _decode_pass(128, 4, 1, 256)
    order = torch.arange(100).view(5, 20).flip(0).reshape(-1)  # B's five blocks of 20 in reverse order
    k, v, members, offsets = window_pass.segments[1]
    window_pass.segments[1] = (k[:, :, order], v[:, :, order], members, offsets)
    window_pass.segment_positions[1] = window_pass.segment_positions[1][order]
    parts = window_pass.decode_parts(128, keys, values, lens)
    assert parts is not None and len(parts.segment_keys) > 3  # B in runs
    batch = avx2.decode_batch_type()(parts.own_keys, parts.own_values, parts.own_lens, parts.segment_keys,
                                     parts.segment_values, parts.segment_members)
    torch.testing.assert_close(batch.attend(queries, 0, 256 ** -0.5)[0], expected, rtol=2e-5, atol=2e-5)


def test_own_kv_out_of_position_order_takes_the_masked_path():
    window_pass, (keys, values, lens), _, _ = _decode_pass(8, 4, 1, 64)
    window_pass.own_positions[0][:] = window_pass.own_positions[0].flip(0)
    assert window_pass.decode_parts(8, keys, values, lens) is None


def test_a_prefilling_pass_takes_the_masked_path():
    window_pass, (keys, values, lens), _, _ = _decode_pass(8, 4, 1, 64)
    window_pass.query_positions[0] = window_pass.own_positions[0][-2:]  # sequence 0 computes two tokens
    assert window_pass.decode_parts(8, keys, values, lens) is None


def test_gemma3_with_256_wide_heads_generates_past_its_window_as_hf(monkeypatch):
    """A tiny Gemma 3 with Gemma 3 270M's head width (256) and a window of 8 in one engine (`exact`): its decode steps
    attend through the kernel, local layers through their window's suffixes, and every greedy token and logprob
    equals HF's forward."""
    tokenizer = make_test_tokenizer()
    served = make_tiny_gemma3(len(tokenizer), head_dim=256, query_pre_attn_scalar=256, sliding_window=8)
    oracle = AutoModelForCausalLM.from_config(served.config, attn_implementation="sdpa").eval()
    oracle.load_state_dict(served.state_dict())
    planned: list[bool] = []
    decode_parts = WindowedPass.decode_parts

    def counted(self, *args, **kwargs):
        parts = decode_parts(self, *args, **kwargs)
        planned.append(parts is not None)
        return parts

    monkeypatch.setattr(WindowedPass, "decode_parts", counted)
    runtime = ModelRuntime(wrap_model(served, tokenizer, name="tiny-gemma3-wide"), build_store(StoreConfig()))
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    assert_batched_generation_equals_hf(runtime, oracle, PROMPTS, num_tokens=12, fidelity=Fidelity("exact"))
    assert planned and all(planned)  # every windowed decode step went through the kernel
