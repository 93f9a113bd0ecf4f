"""Fused bf16 decoder layers (loading/fused_layers.py, attention/csrc/fused_bf16.cpp) against the Hugging Face modules.

Oracle: the same bf16 inputs through transformers' LlamaRMSNorm, apply_rotary_pos_emb, SiLU-gated MLP and
whole models. RoPE must match bit for bit; RMSNorm and SiLU round to bf16 where the modules do but sum
and exponentiate in their own order, so they must match on all but rare elements, and there by one bf16
step. Skipped on CPUs without AVX512-BF16; a CPU that has them and a compiler must build the kernels.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime, SamplingParams, wrap_model
from promptcache.model_runtime.attention import bf16_kernel
from promptcache.model_runtime.engine import Engine, EngineConfig
from promptcache.model_runtime.loading.architectures import ARCHITECTURES
from promptcache.model_runtime.loading.fused_layers import (
    FusedAttention,
    FusedGatedMLP,
    FusedRMSNorm,
    decode_stack_forward,
    fuse_layers,
    fused_stack_forward,
)
from tests.model_factories import make_test_tokenizer, make_tiny_model, tiny_config
from tests.model_runtime.test_torch_layer_ops import assert_rope_matches_hf

pytestmark = pytest.mark.skipif(not bf16_kernel.supported(), reason="this CPU lacks AVX512-BF16")

LLAMA = ARCHITECTURES["llama"]


@pytest.fixture(scope="module")
def ops(bf16_kernels):
    return bf16_kernel.fused_ops()


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal on ≥ 99.9 % of elements; elsewhere within one bf16 step (8 significant bits)."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16
    equal = (got == want).float().mean().item()
    assert equal >= 0.999, f"only {equal:.4%} of elements equal"
    step = want.float().abs() * 2.0 ** -7 + 1e-30
    assert ((got.float() - want.float()).abs() <= step).all()


@pytest.mark.parametrize("width", [576, 896])
def test_rms_norm_matches_llama_rms_norm(ops, width):
    generator = torch.Generator().manual_seed(width)
    norm = LlamaRMSNorm(width, eps=1e-5).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=generator))
    x = (torch.randn(2, 301, width, generator=generator) * 3).bfloat16()
    with torch.inference_mode():
        assert_bf16_close(FusedRMSNorm(norm, ops)(x), norm(x))


@pytest.mark.parametrize("width", [256, 640])
def test_scaled_rms_norm_matches_gemmas_rms_norm(ops, width):
    """`rms_norm_scaled` (Gemma 3's (1 + w) norm: its hidden 640, its q/k heads 256) against HF's Gemma3RMSNorm in
    bf16, which upcasts, scales in fp32 and rounds once."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    generator = torch.Generator().manual_seed(width)
    norm = Gemma3RMSNorm(width, eps=1e-6).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=generator) * 0.5)
    x = (torch.randn(301, width, generator=generator) * 3).bfloat16()
    scale = 1.0 + norm.weight.float()
    with torch.inference_mode():
        assert_bf16_close(ops.rms_norm_scaled(x, scale, 1e-6), norm(x))


@pytest.mark.parametrize("spread", [1.0, 3.0, 10.0])
def test_gelu_tanh_mul_matches_gemmas_mlp_ops(ops, spread):
    """`gelu_tanh_mul` against Gemma 3's MLP ops in bf16, `gelu(gate, approximate="tanh") * up` (its hidden 2048),
    over both tails: where 1 + tanh cancels (gate below about -4) it must round as PyTorch's formula does."""
    from transformers.models.gemma3.configuration_gemma3 import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP

    generator = torch.Generator().manual_seed(int(spread))
    gate_up = (torch.randn(301, 2 * 2048, generator=generator) * spread).bfloat16()
    act_fn = Gemma3MLP(Gemma3TextConfig(hidden_size=64, intermediate_size=2048)).act_fn
    with torch.inference_mode():
        assert_bf16_close(ops.gelu_tanh_mul(gate_up), act_fn(gate_up[:, :2048]) * gate_up[:, 2048:])


def test_gated_mlp_matches_llama_mlp(ops):
    config = LlamaConfig(hidden_size=128, intermediate_size=352)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        mlp = LlamaMLP(config).bfloat16()
    x = torch.randn(3, 57, 128).bfloat16()
    with torch.inference_mode():
        assert_bf16_close(FusedGatedMLP(copy.deepcopy(mlp), ops, LLAMA)(x), mlp(x))
        gate_up = (torch.randn(200, 2 * 352) * 6).bfloat16()  # SiLU over a wide range, both tails
        want = torch.nn.functional.silu(gate_up[:, :352]) * gate_up[:, 352:]
        assert_bf16_close(ops.silu_mul(gate_up), want)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (14, 2, 64), (4, 4, 128)])
def test_rope_matches_apply_rotary_pos_emb_bit_for_bit(ops, heads, kv_heads, dim):
    assert_rope_matches_hf(ops.rope_qk, heads, kv_heads, dim)


def _model(arch: str, vocab_size: int) -> torch.nn.Module:
    """`arch` at the kernels' shapes (heads of 64, Qwen3's of 128) with GQA, random weights, bf16."""
    config = tiny_config(arch, vocab_size=vocab_size, hidden_size=256)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_fused_model_matches_the_hf_model(ops, arch):
    """Whole forward passes (prefill, then decode over the cache): every module swapped, logits as the
    unfused model's within what one differently rounded bf16 element can move them over two layers."""
    plain = _model(arch, 512)
    fused = copy.deepcopy(plain)
    assert fuse_layers(fused) == 2 * 4 + 1  # per layer two norms, attention, MLP; the final norm
    layer = fused.model.layers[0]
    assert isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedGatedMLP)
    ids = torch.randint(0, 512, (2, 77), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, got = plain(ids, use_cache=True), fused(ids, use_cache=True)
        assert (got.logits.float() - want.logits.float()).abs().max() <= 0.05
        step = ids[:, -1:]
        want_next = plain(step, cache=want.past_key_values).logits
        got_next = fused(step, cache=got.past_key_values).logits
        assert (got_next.float() - want_next.float()).abs().max() <= 0.05


DOC = " ".join(f"The river {i} flows north through the valley of stone." for i in range(12))
PROMPTS = ['<prompt schema="s"><doc/>Where does the river flow?</prompt>',
           '<prompt schema="s"><doc/>What is north of the valley? Answer briefly.</prompt>']


def test_engine_with_fused_layers_generates_the_unfused_tokens(ops):
    """The batched engine (module reuse, packed prefill, decode), fused vs the HF modules, both bf16 with
    packed weights as the server loads them: the same greedy tokens."""
    runtimes = [_runtime(fuse) for fuse in (False, True)]
    assert isinstance(runtimes[1].loaded.model.model.layers[0].mlp, FusedGatedMLP)
    params = SamplingParams(max_tokens=12, temperature=0)
    tokens = [_generate(runtime, Engine(runtime.module_encoder, EngineConfig(max_num_seqs=4)), params, _tokens)
              for runtime in runtimes]
    assert tokens[0] == tokens[1] and all(len(t) == 12 for t in tokens[0])


def test_batch_steps_through_the_plain_layer_loops_equal_the_hf_forward(ops):
    """The runner's loops over fused layers — `fused_stack_forward` for any step, `decode_stack_forward` for
    steps in which every sequence decodes — against the Hugging Face forward of the same fused model, in the
    engine's batch steps (module reuse, packed prefill, decode): every token and its top logprobs equal, bit
    for bit, whichever loops run."""
    outputs = []
    for loops in ("both", "stack", "none"):  # a store each: a run must not reuse another one's KV
        runtime = _runtime(True)
        engine = Engine(runtime.module_encoder, EngineConfig(max_num_seqs=4))
        runner = engine.runner
        assert runner.stack is not None and runner.decode_stack is not None
        decode_steps = []
        if loops == "both":
            runner.decode_stack = _counting(runner.decode_stack, decode_steps)
        else:
            runner.decode_stack = None
            if loops == "none":
                runner.stack = None  # the HF model's forward
        outputs.append(_generate(runtime, engine, SamplingParams(max_tokens=10, temperature=0, logprobs=5), _events))
        if loops == "both":  # both prompts decode together after their prefills
            assert decode_steps.count(2) >= 5, decode_steps
    assert outputs[0] == outputs[1] == outputs[2] and all(len(events) == 10 for events in outputs[0])


def _counting(forward, batch_sizes: list[int]):
    """`forward`, recording the batch size (input_ids [1, B]) of each call."""
    def counted(input_ids, *args):
        batch_sizes.append(input_ids.shape[1])
        return forward(input_ids, *args)

    return counted


def _runtime(fuse: bool) -> ModelRuntime:
    """The d64 test model in bf16 with packed weights (fused or not), a store of its own and schema `s`."""
    tokenizer = make_test_tokenizer()
    runtime = ModelRuntime(wrap_model(_model("llama", len(tokenizer)), tokenizer, name="d64", pack_weights=True,
                                      fuse_layers=fuse), build_store(StoreConfig(), device="cpu"))
    runtime.add_schema(runtime.parse_schema(f'<schema name="s"><module name="doc">{DOC}</module></schema>'))
    return runtime


def _generate(runtime: ModelRuntime, engine: Engine, params: SamplingParams, collect) -> list:
    """PROMPTS through `engine` at once, each stream gathered by `collect`; stops the engine."""
    async def run():
        plans = [runtime.plan(p) for p in PROMPTS]
        with engine.inbox.wakeup:  # taken together: every run batches the same steps (the same rows a product)
            streams = [engine.submit(plan, params) for plan in plans]
        return await asyncio.gather(*(collect(stream) for stream in streams))

    try:
        return asyncio.run(run())
    finally:
        engine.stop()


async def _events(stream) -> list[tuple]:
    out = []
    async for event in stream:
        if event.token_id is not None:
            out.append((event.token_id, event.logprobs))
    return out


async def _tokens(stream) -> list[int]:
    out = []
    async for event in stream:
        assert event.report is None or event.report.error is None, event.report
        if event.token_id is not None:
            out.append(event.token_id)
    return out


def test_fuse_layers_leaves_other_models_alone(ops):
    """Models the kernels do not fuse keep their modules and the Hugging Face forward (no plain loop)."""
    tokenizer = make_test_tokenizer()
    for model in (make_tiny_model("llama", vocab_size=len(tokenizer)),  # fp32
                  make_tiny_model("llama", vocab_size=len(tokenizer), dtype=torch.bfloat16),  # head dim 16
                  make_tiny_model("gpt2", vocab_size=len(tokenizer), dtype=torch.bfloat16)):
        assert fuse_layers(model) == 0
        assert fused_stack_forward(model.base_model) is None and decode_stack_forward(model.base_model) is None


def test_no_fusion_or_build_without_the_instructions(monkeypatch):
    monkeypatch.setattr(bf16_kernel, "_state", {})
    monkeypatch.setattr(bf16_kernel, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setattr(bf16_kernel, "_load", lambda: pytest.fail("loaded on a CPU without AVX512-BF16"))
    model = _model("llama", 512)
    assert fuse_layers(model) == 0
    assert isinstance(model.model.layers[0].input_layernorm, LlamaRMSNorm)
