"""The AVX512-BF16 attention kernel against plain fp32 attention over the same bf16 inputs.

Skipped on CPUs without the instructions; on a CPU that has them and a C++ compiler, a failed build fails.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime, SamplingParams, packed_attention, wrap_model
from promptcache.model_runtime.attention import (
    SharedSegment,
    backends,
    bf16_kernel,
    dispatch,
    shared_module_attention,
)
from promptcache.model_runtime.attention.backends import matmul_attend
from promptcache.model_runtime.attention.decode_batch import StepDecode, plan_decode_batch
from promptcache.model_runtime.engine import Engine, EngineConfig
from tests.model_factories import make_test_tokenizer
from tests.model_runtime.test_dtype import _first
from tests.model_runtime.test_shared_attention import make_case, reference

OUT_TOLERANCE = 3e-2  # bf16 output (8 significant bits) and bf16 probabilities in PV
LSE_TOLERANCE = 1e-3  # fp32 softmax statistics over bf16 products

pytestmark = pytest.mark.skipif(not bf16_kernel.supported(), reason="this CPU lacks AVX512-BF16")


@pytest.fixture(scope="module")
def kernel(bf16_kernels):
    return bf16_kernel.loaded()


def oracle(q, k, v, scale, causal):
    """Plain fp32 attention, KV expanded per head, bottom-right causal mask."""
    heads, m, _ = q.shape
    group = heads // k.shape[0]
    n = k.shape[1]
    mask = torch.ones(m, n, dtype=torch.bool).tril(n - m) if causal else None
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    return matmul_attend(q, k, v, scale, None if mask is None else mask.expand(heads, m, n))


SHAPES = [  # (heads, kv heads, rows M, keys N, head dim, causal)
    (9, 3, 100, 100, 64, True), (9, 3, 37, 200, 64, True), (2, 1, 130, 130, 64, True), (4, 4, 1, 1, 64, True),
    (4, 4, 77, 333, 64, False), (14, 2, 1, 65, 64, False), (3, 3, 96, 2048, 64, False), (7, 1, 33, 15, 64, False),
    (4, 2, 70, 129, 128, True), (2, 2, 5, 300, 128, False),
    # decode-shaped (every row sees every key, G x M <= 32 rows per KV head): packed as read, split over keys
    (9, 3, 1, 3001, 64, True), (8, 2, 4, 1000, 128, False), (6, 2, 10, 700, 64, False), (32, 1, 1, 64, 64, False),
    # Gemma 3's heads of 256 (4 query heads, one KV head): a prefill, a new question over cached keys, a decode row
    (4, 1, 300, 300, 256, True), (4, 1, 11, 2211, 256, True), (4, 1, 1, 523, 256, False),
]


@pytest.mark.parametrize("shape", SHAPES,
                         ids=[f"h{h}kv{g}m{m}n{n}d{d}{'c' if c else ''}" for h, g, m, n, d, c in SHAPES])
def test_kernel_matches_plain_attention(kernel, shape):
    heads, kv_heads, m, n, d, causal = shape
    g = torch.Generator().manual_seed(m * 131 + n)
    q, k, v = (torch.randn(h, length, d, generator=g).bfloat16()
               for h, length in ((heads, m), (kv_heads, n), (kv_heads, n)))
    out, lse = kernel(q, [k], [v], d ** -0.5, causal)
    want_out, want_lse = oracle(q, k, v, d ** -0.5, causal)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (heads, m)
    assert (out.float() - want_out).abs().max().item() <= OUT_TOLERANCE
    assert (lse - want_lse).abs().max().item() <= LSE_TOLERANCE


@pytest.mark.parametrize(("heads", "kv_heads", "m", "n", "d", "window"), [
    (4, 1, 300, 300, 256, 64), (4, 1, 11, 600, 256, 512), (9, 3, 200, 300, 64, 100), (2, 2, 70, 70, 128, 1),
    (4, 2, 130, 1000, 64, 2000)])
def test_a_window_hides_the_keys_out_of_each_rows_reach(kernel, heads, kv_heads, m, n, d, window):
    """`window` W: row r of a causal call sees keys r + N - M - W + 1 .. r + N - M (a sliding-window layer over keys at
    consecutive positions; the steps wholly before a block's reach skipped), against plain fp32 attention under that
    band, segments given in pieces; a window longer than the keys is the plain causal call, bit for bit."""
    g = torch.Generator().manual_seed(m * 7 + n + window)
    q = torch.randn(heads, m, d, generator=g).bfloat16()
    k, v = (torch.randn(kv_heads, n, d, generator=g).bfloat16() for _ in range(2))
    cut = n // 3
    out, lse = kernel(q, [k[:, :cut], k[:, cut:]], [v[:, :cut], v[:, cut:]], d ** -0.5, True, [], window)
    last = torch.arange(m)[:, None] + n - m                                  # each row's last visible key
    keys = torch.arange(n)[None, :]
    mask = (keys <= last) & (keys > last - window)
    group = heads // kv_heads
    want_out, want_lse = matmul_attend(q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0), d ** -0.5,
                                       mask.expand(heads, m, n))
    assert (out.float() - want_out).abs().max().item() <= OUT_TOLERANCE
    assert (lse - want_lse).abs().max().item() <= LSE_TOLERANCE
    if window >= n:
        assert all(torch.equal(a, b) for a, b in zip((out, lse), kernel(q, [k], [v], d ** -0.5, True)))
    with pytest.raises(RuntimeError, match="causal calls only"):
        kernel(q, [k], [v], d ** -0.5, False, [], window)


def test_kernel_reads_strided_queries_and_writes_their_layout(kernel):
    """The prefill passes q as a [H, T, D] view of [T, H, D] rows; the output keeps that memory layout."""
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(50, 6, 64, generator=g).bfloat16()        # [T, H, D]
    k, v = torch.randn(2, 50, 64, generator=g).bfloat16(), torch.randn(2, 50, 64, generator=g).bfloat16()
    out, lse = kernel(rows.transpose(0, 1), [k], [v], 0.125, True)
    want_out, want_lse = oracle(rows.transpose(0, 1).contiguous(), k, v, 0.125, True)
    assert out.transpose(0, 1).is_contiguous()
    assert (out.float() - want_out).abs().max().item() <= OUT_TOLERANCE
    assert (lse - want_lse).abs().max().item() <= LSE_TOLERANCE


def test_kernel_rejects_what_it_cannot_compute(kernel):
    q = torch.randn(2, 4, 64).bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel(q.float(), [q.float()], [q.float()], 0.125, False)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel(q, [q, q.float()], [q, q], 0.125, False)
    with pytest.raises(RuntimeError, match="head dim"):
        kernel(torch.randn(2, 4, 32).bfloat16(), [torch.randn(2, 4, 32).bfloat16()],
               [torch.randn(2, 4, 32).bfloat16()], 1.0, False)
    with pytest.raises(RuntimeError, match="N >= M"):
        kernel(q, [q[:, :1], q[:, :1]], [q[:, :1], q[:, :1]], 0.125, True)
    with pytest.raises(RuntimeError, match="segment 1"):
        kernel(q, [q, q], [q, q[:, :3]], 0.125, False)
    with pytest.raises(RuntimeError, match="at least one"):
        kernel(q, [], [], 0.125, False)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_segments_are_attended_as_their_concatenation(kernel, d):
    """Keys and values given as segments (strided views of larger buffers, lengths not multiples of 16)
    give bit for bit what one call over their concatenation gives, causal or not."""
    g = torch.Generator().manual_seed(d)
    lengths = [5, 37, 1, 64, 19]
    buffers = [torch.randn(2, n + 7, d + 32, generator=g).bfloat16() for n in lengths]  # padded rows and columns
    keys = [b[:, 3: 3 + n, :d] for b, n in zip(buffers, lengths)]
    values = [b[:, 3: 3 + n, 32:] for b, n in zip(buffers, lengths)]
    for m, causal in ((1, False), (40, False), (19, True), (126, True)):
        q = torch.randn(6, m, d, generator=g).bfloat16()
        got_out, got_lse = kernel(q, keys, values, d ** -0.5, causal)
        want_out, want_lse = kernel(q, [torch.cat(keys, 1)], [torch.cat(values, 1)], d ** -0.5, causal)
        assert torch.equal(got_out, want_out) and torch.equal(got_lse, want_lse)
        oracle_out, _ = oracle(q, torch.cat(keys, 1), torch.cat(values, 1), d ** -0.5, causal)
        assert (got_out.float() - oracle_out).abs().max().item() <= OUT_TOLERANCE


def test_rows_before_a_segments_first_row_do_not_see_it(kernel):
    """`first_rows` hides a segment from the query rows before it (a module's cached tail positioned after
    some recomputed tokens); the own tokens stay causal. Against plain fp32 attention with that mask; all
    zeros is the same call as none, bit for bit."""
    g = torch.Generator().manual_seed(5)
    lengths, first_rows, m = [40, 23, 70, 55], [0, 9, 30, 0], 50  # three segments, then 5 + 50 own keys
    keys = [torch.randn(2, n, 64, generator=g).bfloat16() for n in lengths]
    values = [torch.randn(2, n, 64, generator=g).bfloat16() for n in lengths]
    q = torch.randn(6, m, 64, generator=g).bfloat16()
    out, lse = kernel(q, keys, values, 0.125, True, first_rows)
    k, v, n = torch.cat(keys, 1), torch.cat(values, 1), sum(lengths)
    key_first_row = torch.repeat_interleave(torch.tensor(first_rows), torch.tensor(lengths))
    mask = torch.ones(m, n, dtype=torch.bool).tril(n - m) & (key_first_row[None, :] <= torch.arange(m)[:, None])
    want_out, want_lse = matmul_attend(q, k.repeat_interleave(3, 0), v.repeat_interleave(3, 0), 0.125,
                                       mask.expand(6, m, n))
    assert (out.float() - want_out).abs().max().item() <= OUT_TOLERANCE
    assert (lse - want_lse).abs().max().item() <= LSE_TOLERANCE
    plain = kernel(q, keys, values, 0.125, True)
    zeros = kernel(q, keys, values, 0.125, True, [0, 0, 0, 0])
    assert all(torch.equal(a, b) for a, b in zip(plain, zeros))
    with pytest.raises(RuntimeError, match="one first row per segment"):
        kernel(q, keys, values, 0.125, True, [0, 1])


def test_batch_decode_attends_each_sequences_own_segments(kernel):
    """`decode_bf16`: one query row per sequence, each over its own list of segments (strided views,
    lengths not multiples of 64, one long enough to be split over the keys), against plain fp32 attention
    per sequence and `flash_bf16` on that sequence alone (the key chunks differ: equal within rounding)."""
    decode = bf16_kernel.decode_loaded()
    for d in (64, 128, 256):
        g = torch.Generator().manual_seed(d + 7)
        lengths = [[300, 1], [17], [2500, 33, 9], [64]]
        buffer = torch.randn(2, 4000, d + 16, generator=g).bfloat16()
        keys, values, start = [], [], 0
        for parts in lengths:
            keys.append([buffer[:, start: start + n, :d] for n in parts])
            values.append([buffer[:, start: start + n, 16:] for n in parts])
            start += sum(parts)
        q = torch.randn(len(lengths), 6, d, generator=g).bfloat16()                      # [B, H, D]
        out, lse = decode(q, keys, values, d ** -0.5)
        assert out.shape == q.shape and lse.shape == (len(lengths), 6)
        for b in range(len(lengths)):
            alone = kernel(q[b].view(2, 3, d), keys[b], values[b], d ** -0.5, False)       # [H_kv, G, D]
            assert (out[b].float() - alone[0].reshape(6, d).float()).abs().max().item() <= OUT_TOLERANCE
            assert (lse[b] - alone[1].reshape(6)).abs().max().item() <= LSE_TOLERANCE
            want_out, want_lse = oracle(q[b].unsqueeze(1), torch.cat(keys[b], 1), torch.cat(values[b], 1),
                                        d ** -0.5, False)
            assert (out[b].float() - want_out[:, 0]).abs().max().item() <= OUT_TOLERANCE
            assert (lse[b] - want_lse[:, 0]).abs().max().item() <= LSE_TOLERANCE
    with pytest.raises(RuntimeError, match="no keys"):
        decode(q[:1], [[buffer[:, :0, :d]]], [[buffer[:, :0, :d]]], 0.1)
    with pytest.raises(RuntimeError, match="one key and one value list per sequence"):
        decode(q, keys[:1], values[:1], 0.1)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_decode_batch_matches_plain_attention_on_every_layer(kernel, d):
    """A decode step planned once for all layers (`plan_decode_batch`): each sequence's own KV (capacity
    past its length), a segment only one sequence sees, segments several share (two with the same
    sequences), one hidden from a sequence by a row offset. Each layer against plain fp32 attention over
    the keys that sequence sees, in order."""
    g = torch.Generator().manual_seed(d)
    layers, heads, kv_heads = 3, 6, 2
    own_lens = [20, 1, 300, 7]

    def kv(n):
        return tuple(torch.randn(layers, kv_heads, n, d, generator=g).bfloat16() for _ in range(2))

    own = [kv(n + 5) for n in own_lens]
    segments = [(*kv(700), (0, 1, 2, 3), None), (*kv(1), (0, 1, 2, 3), None), (*kv(90), (2,), None),
                (*kv(40), (1, 3), (0, 1))]                             # the last: hidden from sequence 3
    query = torch.randn(1, heads, len(own_lens), d, generator=g).bfloat16()  # one layer's [1, H, B, D]
    batch = plan_decode_batch(query, [1] * len(own_lens), [k for k, _ in own], [v for _, v in own], own_lens,
                              segments, "auto")
    assert plan_decode_batch(query, [1, 1, 2, 1], [k for k, _ in own], [v for _, v in own], own_lens, segments,
                             "auto") is None                           # a prefilling sequence: not a decode step
    for layer in range(layers):
        q = torch.randn(len(own_lens), heads, d, generator=g).bfloat16()  # [B, H, D]
        out, lse = batch.attend(q, layer, d ** -0.5)
        for b, n in enumerate(own_lens):
            seen = [(k[layer], v[layer]) for k, v, members, offsets in segments
                    if b in members and not (offsets and offsets[members.index(b)] > 0)]
            keys = torch.cat([k for k, _ in seen] + [own[b][0][layer, :, :n]], 1)
            values = torch.cat([v for _, v in seen] + [own[b][1][layer, :, :n]], 1)
            want_out, want_lse = oracle(q[b].unsqueeze(1), keys, values, d ** -0.5, False)
            assert (out[b].float() - want_out[:, 0]).abs().max().item() <= OUT_TOLERANCE
            assert (lse[b] - want_lse[:, 0]).abs().max().item() <= LSE_TOLERANCE
    with pytest.raises(RuntimeError, match="layer 3 of 3"):
        batch.attend(q, layers, 0.1)


@pytest.mark.parametrize("query_lens", [[1, 5, 1, 1], [1, 1, 1], [3, 1, 1]])
def test_packed_step_splits_decoding_sequences_off_to_the_batch_call(kernel, query_lens):
    """The model's attention function in a packed step: the decoding sequences through one DecodeBatch (all
    of them, or split off beside prefilling ones), the rest through the general path; every row against the
    general path alone (torch's fused op: `fused_cpu`)."""
    g = torch.Generator().manual_seed(sum(query_lens))
    layers, heads, kv_heads, d = 2, 6, 2, 64
    starts = [30, 200, 12, 64][: len(query_lens)]
    own = [tuple(torch.randn(layers, kv_heads, s + n + 3, d, generator=g).bfloat16() for _ in range(2))
           for s, n in zip(starts, query_lens)]
    segments = [(*(torch.randn(layers, kv_heads, n, d, generator=g).bfloat16() for _ in range(2)), members, offsets)
                for n, members, offsets in ((300, tuple(range(len(query_lens))), None), (50, (0,), None),
                                            (40, (0, 1), (0, 2)))]
    query = torch.randn(1, heads, sum(query_lens), d, generator=g).bfloat16()
    outs = {}
    for backend in ("auto", "fused_cpu"):
        context = packed_attention.BatchContext(list(query_lens), [k for k, _ in own], [v for _, v in own],
                                                list(starts), list(segments), backend=backend)
        with packed_attention.active_batch(context):
            outs[backend] = [packed_attention._attention_forward(SimpleNamespace(layer_idx=layer), query, None, None,
                                                                 None, scaling=0.125)[0] for layer in range(layers)]
        if backend == "auto":
            assert isinstance(context.decode, StepDecode)
            assert (context.decode.rows is None) == all(n == 1 for n in query_lens)
    for got, want in zip(outs["auto"], outs["fused_cpu"]):
        assert got.shape == (1, sum(query_lens), heads, d)
        assert (got.float() - want.float()).abs().max().item() <= OUT_TOLERANCE


class Counting:
    """Wraps the loaded kernel and its batch-decode entry; counts calls by causality (`decode`: batch
    decode calls) and the KV segments they were given."""

    def __init__(self, kernel):
        self.kernel, self.calls, self.segments, self.hidden = kernel, {True: 0, False: 0, "decode": 0}, 0, 0
        self.decode, self.decode_batch = bf16_kernel.decode_loaded(), bf16_kernel.decode_batch_type()

    def install(self, monkeypatch):
        monkeypatch.setitem(bf16_kernel._state, "kernel", self)
        monkeypatch.setitem(bf16_kernel._state, "decode", self.count_decode)
        monkeypatch.setitem(bf16_kernel._state, "decode_batch", self.count_decode_batch)
        return self

    def __call__(self, q, k, v, scale, causal, first_rows=()):
        self.calls[causal] += 1
        self.segments += len(k)
        self.hidden += sum(r > 0 for r in first_rows)  # segments hidden from the first rows
        return self.kernel(q, k, v, scale, causal, list(first_rows))

    def count_decode(self, q, k, v, scale):
        self.calls["decode"] += 1
        self.segments += sum(len(parts) for parts in k)
        return self.decode(q, k, v, scale)

    def count_decode_batch(self, own_keys, own_values, own_lens, segment_keys, *args):
        """A DecodeBatch whose per-layer calls count as `decode` calls over all of the step's KV."""
        batch, counting = self.decode_batch(own_keys, own_values, own_lens, segment_keys, *args), self

        class Counted:
            def attend(self, q, layer, scale):
                counting.calls["decode"] += 1
                counting.segments += len(own_keys) + len(segment_keys)
                return batch.attend(q, layer, scale)

        return Counted()


def test_shared_module_attention_runs_every_path_through_the_kernel(kernel, monkeypatch):
    """Segments, causal prefill squares and decoding sequences (one batch call) at head dim 64, bf16."""
    counting = Counting(kernel).install(monkeypatch)
    case = _make_case_d64(5, num_heads=6, num_kv_heads=2, query_lens=[1, 40, 1, 3],
                                  own_lens=[200, 40, 150, 9], segment_specs=[(300, [0, 1, 2, 3]), (70, [1, 3])],
                                  dtype=torch.bfloat16)
    got = shared_module_attention(*case).float()
    assert (got - reference(*case)).abs().max().item() <= OUT_TOLERANCE
    # 2 prefills (own KV, causal); 2 segments seen by several sequences; both decodes in one batch call
    assert counting.calls == {True: 2, False: 2, "decode": 1}
    fused = shared_module_attention(*case, backend="fused_cpu")  # the named backend is torch's op: no calls
    assert counting.calls == {True: 2, False: 2, "decode": 1}
    assert (fused.float() - reference(*case)).abs().max().item() <= OUT_TOLERANCE


def test_segments_of_one_sequence_join_its_own_call(kernel, monkeypatch):
    """Segments only one sequence sees are attended in that sequence's own call: a lone prefill over three
    modules is ONE kernel call with four KV segments; in a batch, the decoding sequences (one with a module
    of its own) share one batch-decode call, and the shared segment keeps its call. Both against the oracle."""
    counting = Counting(kernel).install(monkeypatch)
    lone = _make_case_d64(11, num_heads=6, num_kv_heads=2, query_lens=[23], own_lens=[30],
                          segment_specs=[(100, [0]), (37, [0]), (250, [0])], dtype=torch.bfloat16)
    assert (shared_module_attention(*lone).float() - reference(*lone)).abs().max().item() <= OUT_TOLERANCE
    assert counting.calls == {True: 1, False: 0, "decode": 0} and counting.segments == 4
    batch = _make_case_d64(12, num_heads=6, num_kv_heads=2, query_lens=[1, 17, 1], own_lens=[20, 17, 30],
                           segment_specs=[(90, [0]), (60, [0, 1, 2]), (45, [1])], dtype=torch.bfloat16)
    counting.calls, counting.segments = {True: 0, False: 0, "decode": 0}, 0
    assert (shared_module_attention(*batch).float() - reference(*batch)).abs().max().item() <= OUT_TOLERANCE
    # seq 1's prefill with its module (2 segments); the shared one (1); seqs 0 and 2 decode in one call,
    # seq 0 with its module (2 segments), seq 2 with its own KV only (1)
    assert counting.calls == {True: 1, False: 1, "decode": 1} and counting.segments == 6


def test_segments_positioned_after_some_new_tokens_join_the_call_too(kernel, monkeypatch):
    """A prefill that recomputes tokens among cached ones (`balanced`): segments with row offsets join the
    sequence's one call, hidden from the rows before them; one beyond the last row is dropped. Against the
    per-segment path (torch's op, bf16) and plain fp32 attention (matmul backend)."""
    counting = Counting(kernel).install(monkeypatch)
    queries, lens, own_k, own_v, segments = _make_case_d64(
        13, num_heads=6, num_kv_heads=2, query_lens=[30], own_lens=[34],
        segment_specs=[(50, [0]), (40, [0]), (25, [0]), (33, [0])], dtype=torch.bfloat16)
    segments = [SharedSegment(s.keys, s.values, s.seq_indices, (offset,))
                for s, offset in zip(segments, (0, 12, 29, 35))]
    got = shared_module_attention(queries, lens, own_k, own_v, segments).float()
    assert counting.calls == {True: 1, False: 0, "decode": 0} and counting.segments == 4 and counting.hidden == 2
    per_segment = shared_module_attention(queries, lens, own_k, own_v, segments, backend="fused_cpu").float()
    plain = shared_module_attention(queries.float(), lens, [k.float() for k in own_k], [v.float() for v in own_v],
                                    [SharedSegment(s.keys.float(), s.values.float(), s.seq_indices, s.row_offsets)
                                     for s in segments], backend="matmul")
    assert (got - per_segment).abs().max().item() <= OUT_TOLERANCE
    assert (got - plain).abs().max().item() <= OUT_TOLERANCE


def _make_case_d64(seed, **kwargs):
    """make_case at head dim 64 (the kernel's), by scaling up its d = 16 tensors' last dim."""
    queries, query_lens, own_k, own_v, segments = make_case(seed, **kwargs)
    widen = lambda t: t.repeat_interleave(4, dim=-1) * 0.5  # noqa: E731 - [.., 16] -> [.., 64], same logits scale
    return (widen(queries), query_lens, [widen(k) for k in own_k], [widen(v) for v in own_v],
            [SharedSegment(widen(s.keys), widen(s.values), s.seq_indices) for s in segments])


def test_auto_dispatch_picks_the_kernel_for_bf16_only(kernel):
    q16, k16 = torch.randn(2, 8, 64).bfloat16(), torch.randn(2, 40, 64).bfloat16()
    assert dispatch.choose("auto", q16, k16) is backends.bf16_cpu_attend
    assert dispatch.choose("auto", q16.float(), k16.float()) is backends.fused_cpu_attend
    assert dispatch.choose("fused_cpu", q16, k16) is backends.fused_cpu_attend
    assert bf16_kernel.eligible(torch.randn(2, 8, 32).bfloat16(), k16[..., :32], k16[..., :32]) is None


def test_unsupported_cpu_never_builds(monkeypatch):
    monkeypatch.setattr(bf16_kernel, "_state", {})
    monkeypatch.setattr(bf16_kernel, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setattr(bf16_kernel, "_load", lambda: pytest.fail("loaded on a CPU without AVX512-BF16"))
    assert not bf16_kernel.prepare()
    assert bf16_kernel.loaded() is None
    assert bf16_kernel.eligible(torch.randn(2, 4, 64).bfloat16(), torch.randn(2, 4, 64).bfloat16(),
                                torch.randn(2, 4, 64).bfloat16()) is None


def _runtime_d64() -> ModelRuntime:
    """A small Llama with head dim 64 (hidden 256, 4 heads, 2 KV heads), bf16, over the test tokenizer."""
    tokenizer = make_test_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         initializer_range=0.1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    return ModelRuntime(wrap_model(model, tokenizer, name="d64"), build_store(StoreConfig(), device="cpu"))


def test_engine_with_the_kernel_agrees_with_torchs_fused_op(kernel, monkeypatch):
    """The batched engine in bf16, `auto` (the kernel) vs `fused_cpu` (torch's op), same prompts reusing a
    module: first-token distributions agree within bf16 precision, and the kernel ran."""
    counting = Counting(kernel).install(monkeypatch)
    runtime = _runtime_d64()
    doc = " ".join(f"The river {i} flows north through the valley of stone." for i in range(20))
    runtime.add_schema(runtime.parse_schema(f'<schema name="s"><module name="doc">{doc}</module></schema>'))
    prompts = ['<prompt schema="s"><doc/>Where does the river flow? Tell me in one word.</prompt>',
               '<prompt schema="s"><doc/>What is north of the valley?</prompt>']
    probs, kernel_calls = {}, {}
    for backend in ("fused_cpu", "auto"):
        calls_before, segments_before = sum(counting.calls.values()), counting.segments
        engine = Engine(runtime.module_encoder, EngineConfig(max_num_seqs=4, attention_backend=backend))
        params = SamplingParams(max_tokens=1, temperature=0, logprobs=20)

        async def run(engine=engine, params=params):
            return await asyncio.gather(*(_first(engine.submit(runtime.plan(p), params)) for p in prompts))

        try:
            probs[backend] = asyncio.run(run())
        finally:
            engine.stop()
        kernel_calls[backend] = (sum(counting.calls.values()) - calls_before, counting.segments - segments_before)
    # the kernel ran for `auto` only, each call over the module's KV and the prompt's own (one call or several)
    calls, segments = kernel_calls["auto"]
    assert kernel_calls["fused_cpu"] == (0, 0) and calls >= 2 and segments >= 2 * calls
    for want, got in zip(probs["fused_cpu"], probs["auto"]):
        shared = set(want) & set(got)
        assert len(shared) >= 15
        assert max(abs(want[t] - got[t]) for t in shared) <= 0.02
