"""The shared-prefix Triton kernel (attention/triton_shared.py) against plain attention: an fp32 softmax over
exactly the keys each query sees (its sequence's segments from their row offsets on, its own KV up to itself).
On a GPU the kernels run compiled; without one in Triton's interpreter, which must be on before Triton is first
imported (scripts/test.sh runs this file so: TRITON_INTERPRET=1; tests/model_runtime/triton_interpreter.py)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from promptcache.model_runtime import SamplingParams
from promptcache.model_runtime.attention import shared_prefix
from promptcache.model_runtime.attention.shared_prefix import plan_shared_prefix
from promptcache.model_runtime.engine import Engine, EngineConfig, Fidelity
from promptcache.model_runtime.engine.runner import ModelRunner
from tests.conftest import make_tiny_runtime
from tests.model_runtime.batched_generation import assert_batched_generation_equals_hf, assert_exact_prefill_equals_hf
from tests.model_runtime.engine_probe import feed
from tests.model_runtime.oracles import reference_tokens
from tests.model_runtime.test_engine import SCHEMA, _collect, _prompts
from tests.model_runtime.test_fidelity import PROMPTS as WINDOW_PROMPTS
from tests.model_runtime.test_kv_pool import _loaded, _sequences
from tests.model_runtime.test_sliding_window import _pass as windowed_pass
from tests.model_runtime.test_sliding_window import _served as served_windowed
from tests.model_runtime.triton_interpreter import skip_unless_kernels_run

DEVICE = skip_unless_kernels_run()
assert shared_prefix.load_kernel(), "triton imports: the op must register"

# fp32 runs at IEEE precision inside tl.dot; bf16 within its rounding.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
NUM_LAYERS, LAYER = 2, 1  # the second layer: layer strides are applied


class Case:
    """A pass: queries [Q, H, D] (a transposed view, as the engine hands them), a pool [L, H_kv, slots, D]
    whose unused slots hold NaN (a read of one would show), segments as the engine holds them."""

    def __init__(self, dtype: torch.dtype, query_lens: list[int], own_lens: list[int], firsts: list[int],
                 segments: list[tuple[int, tuple[int, ...], tuple[int, ...] | None]], num_heads: int,
                 num_kv_heads: int, head_dim: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

        self.query_lens, self.own_lens, self.firsts = query_lens, own_lens, firsts
        self.num_kv_heads = num_kv_heads
        num_tokens, num_slots = sum(query_lens), max(f + n for f, n in zip(firsts, own_lens)) + 8
        self.queries = rand(1, num_heads, num_tokens, head_dim)[0].transpose(0, 1)  # [Q, H, D], not contiguous
        shape = (NUM_LAYERS, num_kv_heads, num_slots, head_dim)
        self.pool_keys = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        self.pool_values = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        for first, n in zip(firsts, own_lens):
            self.pool_keys[:, :, first:first + n] = rand(NUM_LAYERS, num_kv_heads, n, head_dim)
            self.pool_values[:, :, first:first + n] = rand(NUM_LAYERS, num_kv_heads, n, head_dim)
        self.segments = []
        for j, (length, members, offsets) in enumerate(segments):
            # Keys: a view into a longer buffer (offset and token stride not the segment's); values: [L, n, H_kv, D]
            # permuted, another stride order. The kernel reads both where they lie.
            keys = rand(NUM_LAYERS, num_kv_heads, length + 5, head_dim)[:, :, 3 + j % 2: 3 + j % 2 + length]
            values = rand(NUM_LAYERS, length, num_kv_heads, head_dim).permute(0, 2, 1, 3)
            self.segments.append((keys, values, members, offsets))
        self.scale = head_dim ** -0.5

    def run(self, num_chunks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        plan = plan_shared_prefix(self.query_lens, self.own_lens, self.firsts, self.pool_keys, self.pool_values,
                                  self.segments, num_heads=self.queries.shape[1], num_chunks=num_chunks)
        assert plan is not None
        return plan.attend(self.queries, LAYER, self.scale)

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """out [Q, H, D] and lse [Q, H] fp32: per query, a softmax over the keys it sees (none: 0 and -inf)."""
        num_tokens, num_heads, head_dim = self.queries.shape
        out = torch.zeros((num_tokens, num_heads, head_dim))
        lse = torch.full((num_tokens, num_heads), float("-inf"))
        token = 0
        for i, n in enumerate(self.query_lens):
            for t in range(n):
                keys, values = [], []
                for k, v, members, offsets in self.segments:
                    if i in members and t >= (offsets[members.index(i)] if offsets else 0):
                        keys.append(k[LAYER])
                        values.append(v[LAYER])
                seen = self.own_lens[i] - n + t + 1  # own keys 0 .. own_len - T + t: bottom-right causal
                own = slice(self.firsts[i], self.firsts[i] + max(seen, 0))
                keys.append(self.pool_keys[LAYER, :, own])
                values.append(self.pool_values[LAYER, :, own])
                group = num_heads // self.num_kv_heads
                k = torch.cat(keys, 1).float().cpu().repeat_interleave(group, 0)       # [H, N, D]
                v = torch.cat(values, 1).float().cpu().repeat_interleave(group, 0)
                if k.shape[1]:
                    scores = torch.einsum("hd,hnd->hn", self.queries[token].float().cpu(), k) * self.scale
                    lse[token] = torch.logsumexp(scores, -1)
                    out[token] = torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), v)
                token += 1
        return out, lse

    def check(self, num_chunks: int | None = None) -> None:
        got_out, got_lse = self.run(num_chunks)
        want_out, want_lse = self.reference()
        dtype = self.queries.dtype
        assert got_out.dtype == dtype and got_out.shape == self.queries.shape
        assert got_lse.dtype == torch.float32 and got_lse.shape == self.queries.shape[:2]
        assert torch.equal(got_lse.isinf().cpu(), want_lse.isinf())  # rows that see nothing, exactly those
        finite = want_lse.isfinite()
        assert (got_lse.cpu()[finite] - want_lse[finite]).abs().max().item() <= TOLERANCE[dtype] * 4
        assert (got_out.float().cpu() - want_out).abs().max().item() <= TOLERANCE[dtype]


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_chunks", [1, 3])  # 3 chunks: partial ones, and a 37-key segment's last is short
def test_decode_rows_over_segments_of_different_members(dtype, num_chunks):
    # Five decoding sequences (GQA 4/2): one segment all see, one two see, an empty one, one only sequence 2
    # sees; own KV of 1 to 70 keys at scattered slots, and none at all (sequence 3: shared keys only).
    Case(dtype, query_lens=[1] * 5, own_lens=[1, 5, 70, 0, 17], firsts=[0, 100, 10, 250, 200],
         segments=[(150, (0, 1, 2, 3, 4), None), (37, (0, 3), None), (0, (1,), None), (70, (2,), None)],
         num_heads=4, num_kv_heads=2, head_dim=32).check(num_chunks)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_rows_causal_within_own_tokens_and_segments_from_their_row_offsets(dtype):
    # Two sequences of 7 new tokens (GQA 6/2, head dim 24: masked to a 32-wide block): sequence 1 has 13 own
    # keys before them; a segment sequence 0 sees from its 4th query on, one sequence 1 sees from its 6th.
    Case(dtype, query_lens=[7, 7], own_lens=[7, 20], firsts=[40, 3],
         segments=[(90, (0, 1), (3, 0)), (20, (1,), (5,))], num_heads=6, num_kv_heads=2, head_dim=24,
         seed=1).check(num_chunks=2)


def test_a_mixed_pass_decode_beside_prefill_chunks():
    # Query lengths differ per sequence (1, 6, 3): the tables hold each one's start and length.
    Case(torch.float32, query_lens=[1, 6, 3], own_lens=[9, 6, 40], firsts=[0, 20, 60],
         segments=[(65, (0, 1, 2), (0, 2, 0)), (16, (2, 0), None)], num_heads=8, num_kv_heads=8, head_dim=16,
         seed=2).check()


def test_rows_that_see_nothing_give_zeros_and_minus_infinity():
    # No segments; a sequence with no own key (a padded row: length 0) beside one with some.
    case = Case(torch.float32, query_lens=[1, 1], own_lens=[0, 4], firsts=[0, 8], segments=[], num_heads=2,
                num_kv_heads=1, head_dim=16, seed=3)
    case.check()
    out, lse = case.run()
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool(lse[0].isneginf().all())


def test_a_pass_outside_the_pool_or_of_mixed_dtypes_is_not_planned():
    case = Case(torch.float32, query_lens=[1], own_lens=[3], firsts=[0], segments=[(8, (0,), None)], num_heads=2,
                num_kv_heads=1, head_dim=16)
    assert plan_shared_prefix([1], [3], [None], case.pool_keys, case.pool_values, case.segments, num_heads=2) is None
    other = [(k.double(), v.double(), m, o) for k, v, m, o in case.segments]
    assert plan_shared_prefix([1], [3], [0], case.pool_keys, case.pool_values, other, num_heads=2) is None


def _op_arguments(case: Case) -> tuple:
    plan = plan_shared_prefix(case.query_lens, case.own_lens, case.firsts, case.pool_keys, case.pool_values,
                              case.segments, num_heads=case.queries.shape[1], num_chunks=2)
    assert plan is not None
    return (case.queries, plan.pool_keys, plan.pool_values, plan.seq_table, plan.token_table, plan.segment_table,
            plan.segment_rows, LAYER, case.scale, plan.num_chunks, plan.max_query_len)


def test_the_fake_implementation_gives_the_real_shapes_and_dtypes():
    case = Case(torch.bfloat16, query_lens=[2, 2], own_lens=[2, 5], firsts=[0, 10], segments=[(20, (0, 1), None)],
                num_heads=4, num_kv_heads=2, head_dim=16)
    arguments = _op_arguments(case)
    real_out, real_lse = torch.ops.promptcache.shared_prefix_attention(*arguments)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in arguments]
        out, lse = torch.ops.promptcache.shared_prefix_attention(*fake)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (real_out.shape, real_out.dtype, real_lse.shape,
                                                            real_lse.dtype)


def test_opcheck_schema_and_fake_tensor():
    case = Case(torch.float32, query_lens=[1, 1], own_lens=[3, 4], firsts=[0, 8], segments=[(12, (1,), None)],
                num_heads=2, num_kv_heads=1, head_dim=16)
    torch.library.opcheck(torch.ops.promptcache.shared_prefix_attention.default, _op_arguments(case),
                          test_utils=("test_schema", "test_faketensor"))


class Calls(list):
    """The layers of the kernel's calls, in order; `windows`: each call's sliding window (None: full attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.windows: list[int | None] = []


@pytest.fixture
def kernel_on_test_device(monkeypatch):
    """The engine's passes take the kernel on the test device in fp32 too (on a CPU: Triton's interpreter);
    yields the list of layers each kernel call attended."""
    monkeypatch.setattr(shared_prefix, "KERNEL_DEVICE_TYPES", frozenset({DEVICE}))
    monkeypatch.setattr(shared_prefix, "KERNEL_DTYPES", frozenset({torch.float32}))
    attend, layers = shared_prefix.SharedPrefixPlan.attend, Calls()

    def counted(self, queries, layer, scale, window=None):
        layers.append(layer)
        layers.windows.append(window)
        return attend(self, queries, layer, scale, window)

    monkeypatch.setattr(shared_prefix.SharedPrefixPlan, "attend", counted)
    return layers


@pytest.mark.parametrize("num_tokens", [1, 3], ids=["decode", "prefill"])
@pytest.mark.parametrize("pooled", [{0, 1, 2}, {0, 2}], ids=["pooled", "one-outside"])
def test_an_engine_pass_equals_the_general_path(num_tokens, pooled, kernel_on_test_device):
    loaded = _loaded(2, DEVICE)

    def logits() -> torch.Tensor:
        seqs = _sequences(loaded, 3, pooled)  # the same KV each time (seeded)
        for seq in seqs:  # the last num_tokens - 1 own keys fed again as new tokens
            seq.own_length -= num_tokens - 1
            position = seq.pending_positions[0] - num_tokens + 1
            seq.pending_ids = [7 + k for k in range(num_tokens)]
            seq.pending_positions = list(range(position, position + num_tokens))
        return feed(ModelRunner(loaded), seqs)

    with pytest.MonkeyPatch.context() as off:
        off.setattr(shared_prefix, "KERNEL_DEVICE_TYPES", frozenset())
        expected = logits()
    got = logits()
    # A sequence with KV outside the pool: the pass takes the general path.
    assert kernel_on_test_device == ([0, 1] if len(pooled) == 3 else [])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_the_engine_through_the_kernel_answers_as_full_prefill(kernel_on_test_device):
    runtime = make_tiny_runtime("llama", device=DEVICE)
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    rng = random.Random(4)
    prompts = _prompts(rng, 4)  # cached modules shared by some of them, prefill chunks, batched decode
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, n=2 if i % 2 else 1)
              for i in range(len(prompts))]
    expected = [reference_tokens(runtime.loaded, runtime.plan(p), sp) for p, sp in zip(prompts, params)]
    engine = Engine(runtime.module_encoder, EngineConfig(max_num_seqs=4, prefix=None))

    async def main():
        return await asyncio.gather(*(_collect(engine.submit(runtime.plan(p), sp)) for p, sp in zip(prompts, params)))

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    assert kernel_on_test_device, "the engine's passes took the kernel"
    for result, want, sp in zip(results, expected, params):
        assert result["final"].report.error is None
        assert all(result["tokens"][i] == want for i in range(sp.n))


def _windowed_plan(window: int, poison: bool):
    """test_sliding_window's pass (two sequences, three segments, discontinuous positions) as the kernel takes it: each
    sequence's own KV copied into a NaN-filled pool; returns the plan, its queries and the float64 oracle's output."""
    window_pass, queries, own_kv, expected = windowed_pass(window, poison=poison)
    own_keys, own_values = zip(*(own_kv(layer) for layer in range(2)))  # per layer, per sequence [H_kv, n, D]
    lengths = [k.shape[1] for k in own_keys[0]]
    firsts = [3, 3 + lengths[0] + 4]
    shape = (2, own_keys[0][0].shape[0], firsts[-1] + lengths[-1] + 2, own_keys[0][0].shape[2])
    pool_keys, pool_values = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    for layer in range(2):
        for seq, first in enumerate(firsts):
            pool_keys[layer, :, first:first + lengths[seq]] = own_keys[layer][seq]
            pool_values[layer, :, first:first + lengths[seq]] = own_values[layer][seq]
    segments = [(k.to(DEVICE), v.to(DEVICE), m, o) for k, v, m, o in window_pass.segments]
    positions = shared_prefix.PassPositions(window_pass.query_positions, window_pass.own_positions,
                                            window_pass.segment_positions)
    plan = plan_shared_prefix([p.numel() for p in window_pass.query_positions], lengths, firsts, pool_keys.to(DEVICE),
                              pool_values.to(DEVICE), segments, num_heads=queries.shape[1], num_chunks=2,
                              positions=positions)
    assert plan is not None
    return plan, queries.to(DEVICE), expected


@pytest.mark.parametrize("poison", [False, True], ids=["plain", "out-of-reach-nan"])
@pytest.mark.parametrize("window", [4, 8, 12, 25, 100])
def test_a_windowed_layer_equals_plain_masked_attention(window, poison):
    """A local layer (window W) through the kernel: every query over the keys it sees at positions q - k < W (segments
    from their row offsets on, own KV causally), against float64 masked attention. Poisoned: KV beyond every query's
    reach set to NaN is never loaded (a load, even masked out of the softmax, would spread NaN)."""
    plan, queries, expected = _windowed_plan(window, poison)
    head_dim = queries.shape[2]
    out, lse = plan.attend(queries, 0, head_dim ** -0.5, window=window)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out.cpu(), expected, rtol=2e-5, atol=2e-5)
    if not poison:  # the full layer of the same plan ignores positions: different from the window's answer
        full, _ = plan.attend(queries, 0, head_dim ** -0.5)
        assert (window >= 100) == torch.allclose(full.cpu(), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_windowed_models_through_the_kernel_equal_the_hf_forward(request, arch, kernel_on_test_device):
    """Tiny windowed models (window 8, ~40-token prompts) with every pass through the kernel: `exact` prefill over
    cached modules and batched greedy generation past the window equal HF's own forward; the local layers' calls
    carried their window."""
    runtime, oracle = served_windowed(arch, "hf", request)
    assert_exact_prefill_equals_hf(runtime, oracle, WINDOW_PROMPTS, Fidelity("exact"))
    assert_batched_generation_equals_hf(runtime, oracle, WINDOW_PROMPTS, num_tokens=12, fidelity=Fidelity("exact"))
    windows = {w for w in kernel_on_test_device.windows}
    assert windows == ({8} if arch == "mistral" else {8, None})
