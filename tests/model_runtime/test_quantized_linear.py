"""int8 / int4 linear layers (loading/quantized_linear.py) and GGUF Q4_1 blocks (loading/gguf_weights.py; the other
block types: test_gguf_blocks.py).

Oracles: a float matmul of the dequantized weight; the `gguf` package's own quantization and
dequantization; transformers' GGUF loader (the converted default model) and its q/k row permutation; the
native model through the same engine; a full prefill of the quantized model itself.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelConfig, ModelRuntime, SamplingParams, WeightFormat, load_model, wrap_model
from promptcache.model_runtime.attention import bf16_kernel
from promptcache.model_runtime.baseline import full_prefill_logits
from promptcache.model_runtime.engine import Engine, EngineConfig
from promptcache.model_runtime.loading.fused_layers import FusedAttention
from promptcache.model_runtime.loading.gguf_weights import read_layers
from promptcache.model_runtime.loading.quantized_linear import (
    GROUP_SIZE,
    INT4_DEQUANTIZE_ROWS,
    INT8_DEQUANTIZE_ROWS,
    Int4Blocks,
    Int4Linear,
    Int8Linear,
)
from promptcache.model_runtime.loading.stored_linear import Int8BlockLinear, SplitByteLinear, int8_blocks_run_here
from tests.model_factories import make_test_tokenizer, make_tiny_model
from tests.model_runtime.oracles import reference_greedy

SCHEMA = '<schema name="g">A short preface.<module name="m">Some module text for generation.</module></schema>'
PROMPT = '<prompt schema="g"><m/>Continue:</prompt>'
AMAZON_SCHEMA = """<schema name="smol">
  <system>You are a helpful assistant. Answer in one short sentence.</system>
  <user><module name="doc">The Amazon river flows east across South America and empties into the Atlantic
    Ocean. It carries more water than any other river on Earth.</module></user>
</schema>"""
AMAZON_TEXT = (
    "The Amazon river flows east across South America and empties into the Atlantic Ocean. It carries more "
    "water than any other river on Earth. Its basin covers about seven million square kilometres, most of it "
    "rainforest, and is home to millions of species of insects, plants, birds and other forms of life. The "
    "river was named by Spanish explorers in the sixteenth century. Today, cities such as Manaus and Iquitos "
    "stand on its banks, and boats carry people and goods along it because few roads cross the forest.")
AMAZON_PROMPT = '<prompt schema="smol"><user><doc/>Into which ocean does the Amazon flow?</user><assistant/></prompt>'


def _linear(out_features: int, in_features: int, dtype: torch.dtype, seed: int = 0) -> torch.nn.Linear:
    generator = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=generator) * 0.1)
        linear.bias.copy_(torch.randn(out_features, generator=generator))
    return linear.requires_grad_(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [5, INT8_DEQUANTIZE_ROWS])  # the kernel; the dequantized copy
def test_int8_linear_is_the_float_matmul_of_its_dequantized_weight(dtype, num_rows):
    linear = _linear(96, 160, dtype)
    layer = Int8Linear(linear)
    x = torch.randn(2, num_rows, 160).to(dtype)  # [batch, rows, in]
    want = torch.nn.functional.linear(x.float(), layer.dequantized(), linear.bias.float())
    got = layer(x)
    assert got.shape == (2, num_rows, 96) and got.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want, rtol=tolerance, atol=tolerance)
    # Round to nearest against each channel's symmetric scale: off by at most half a step.
    step = linear.weight.float().abs().amax(dim=1, keepdim=True) / 127
    assert ((layer.dequantized() - linear.weight.float()).abs() <= step * 0.51).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [7, INT4_DEQUANTIZE_ROWS])
@pytest.mark.parametrize("out_features", [48, 192])  # the kernel at any rows; a dequantized copy from the packing
def test_int4_linear_is_the_float_matmul_of_its_blocks(dtype, num_rows, out_features):
    linear = _linear(out_features, 4 * GROUP_SIZE, dtype)
    blocks = Int4Blocks.of(linear.weight, dtype)
    layer = Int4Linear(blocks, linear.bias, dtype)
    assert layer.can_dequantize == (out_features % 64 == 0)
    x = torch.randn(3, num_rows, 4 * GROUP_SIZE).to(dtype)
    want = torch.nn.functional.linear(x.float(), blocks.dequantized(), linear.bias.float())
    got = layer(x)
    assert got.shape == (3, num_rows, out_features) and got.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want, rtol=tolerance, atol=tolerance)
    if dtype == torch.float32:  # min/max groups of 16 levels: off by at most half a step
        step = blocks.scales.repeat_interleave(GROUP_SIZE, dim=1)
        assert ((blocks.dequantized() - linear.weight).abs() <= step * 0.51).all()


def _q4_1_file(path, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A GGUF file with `tensors` quantized by the gguf package (Q4_1, a Q8_0 embedding); returns the bytes."""
    writer = GGUFWriter(path, "llama")
    stored = {}
    for name, weight in tensors.items():
        kind = GGMLQuantizationType.Q8_0 if name == "token_embd.weight" else GGMLQuantizationType.Q4_1
        stored[name] = quantize(weight, kind)
        writer.add_tensor(name, stored[name], raw_shape=stored[name].shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def test_q4_1_blocks_dequantize_bit_exactly_as_gguf_does(tmp_path):
    """Each Q4_1 block loads as stored and the int4 layer (fp32: kernel and dequantized copy) multiplies by
    exactly the weight gguf's dequantize gives; q and k rows come back in the order transformers' GGUF
    loader puts them in."""
    rng = np.random.default_rng(0)
    heads, kv_heads, head_dim = 4, 2, 32
    tensors = {"blk.0.attn_q.weight": rng.standard_normal((heads * head_dim, 128)),
               "blk.0.attn_k.weight": rng.standard_normal((kv_heads * head_dim, 128)),
               "blk.0.ffn_down.weight": rng.standard_normal((64, 256)) * 0.02,
               "token_embd.weight": rng.standard_normal((32, 64))}
    stored = _q4_1_file(tmp_path / "m.gguf", {k: v.astype(np.float32) for k, v in tensors.items()})
    blocks = read_layers(tmp_path / "m.gguf", heads, kv_heads).blocks
    assert set(blocks) == {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                           "model.layers.0.mlp.down_proj"}  # the Q8_0 embedding is not 4-bit
    processor = LlamaTensorProcessor({"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    for gguf_name, hf_name in [("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj"),
                               ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj"),
                               ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj")]:
        weights = dequantize(stored[gguf_name], GGMLQuantizationType.Q4_1)
        want = torch.from_numpy(processor.process(weights, gguf_name).weights.copy())
        layer = Int4Linear(blocks[hf_name], None, torch.float32)
        with torch.no_grad():
            kernel_weight = layer(torch.eye(layer.in_features)).t()  # row i of eye picks input i
        assert torch.equal(blocks[hf_name].dequantized(), want)
        assert torch.equal(kernel_weight, want)
        assert layer.can_dequantize and torch.equal(layer.dequantized_t().t(), want)


def test_smollm2_q4_1_blocks_are_the_weights_transformers_loads(smollm2):
    """The default model's GGUF: every decoder-layer projection is Q4_1 (the embedding is Q8_0, the norms
    F32), and the blocks are bit for bit the fp32 weights transformers dequantized from the same file."""
    from safetensors.torch import load_file

    from promptcache.model_runtime.loading.default_model import default_model_path, gguf_path

    config = smollm2.model.config
    blocks = read_layers(gguf_path(), config.num_attention_heads, config.num_key_value_heads).blocks
    assert len(blocks) == 7 * config.num_hidden_layers
    converted = load_file(default_model_path() / "model.safetensors")
    for name, layer_blocks in blocks.items():
        assert torch.equal(layer_blocks.dequantized(), converted[f"{name}.weight"]), name


def test_int4_smollm2_in_fp32_computes_the_native_model(smollm2):
    """fp32 holds every Q4_1 and Q8_0 weight exactly, so the int4 model (blocks as stored) is the native model:
    logits as the native model's up to summation order, the same greedy tokens through the engine."""
    int4 = load_model(ModelConfig(weights=WeightFormat.INT4))
    assert int4.model_fingerprint != smollm2.model_fingerprint
    head_type = Int8BlockLinear if int8_blocks_run_here(int4.model.dtype) else SplitByteLinear
    assert type(int4.model.lm_head) is head_type  # the file's Q8_0 head, as stored
    ids = smollm2.tokenizer.encode("The Amazon river flows east across South America into the")
    positions = list(range(len(ids)))
    want = full_prefill_logits(smollm2.model, ids, positions)
    got = full_prefill_logits(int4.model, ids, positions)
    assert (got - want).abs().max().item() <= 1e-3
    assert _answer(int4, 6) == _answer(smollm2, 6)


@pytest.mark.parametrize("weights", [WeightFormat.INT8, WeightFormat.INT4])
def test_quantized_smollm2_in_bf16_stays_close_to_native(weights):
    """bf16 as served on CPUs with native bf16: the next-token argmax over a 103-token text agrees with the
    native model's at >= 90 % of positions and no logit moves by more than 2.5 (measured: int8 96 % and
    1.75, int4 98 % and 0.94; native bf16 against fp32: 98 % and 0.82); through the engine it still
    answers the question from its document."""
    native = load_model(ModelConfig(dtype="bfloat16"))
    quantized = load_model(ModelConfig(dtype="bfloat16", weights=weights))
    ids = native.tokenizer.encode(AMAZON_TEXT)
    positions = list(range(len(ids)))
    want = full_prefill_logits(native.model, ids, positions).float()
    got = full_prefill_logits(quantized.model, ids, positions).float()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9
    assert (got - want).abs().max().item() <= 2.5
    answer = quantized.tokenizer.decode(_answer(quantized, 20))
    assert "Atlantic" in answer, answer


@pytest.mark.parametrize("weights", [WeightFormat.INT8, WeightFormat.INT4])
def test_engine_with_quantized_tiny_model_generates_its_full_prefill_tokens(weights):
    """Module reuse, cached prefill and decode over quantized layers: the tokens a full prefill of the same
    quantized model gives; a layer the int4 kernel cannot take (the 521-token head) stays float."""
    tokenizer = make_test_tokenizer()
    loaded = wrap_model(make_tiny_model("llama", vocab_size=len(tokenizer)), tokenizer, name="tiny-llama",
                        weights=weights, pack_weights=True)
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.mlp.up_proj, Int8Linear if weights is WeightFormat.INT8 else Int4Linear)
    assert not isinstance(loaded.model.lm_head, (Int8Linear, Int4Linear))  # the output head stays as loaded
    runtime = ModelRuntime(loaded, build_store(StoreConfig(), device="cpu"))
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    plan = runtime.plan(PROMPT)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert _serve(runtime, plan, params) == reference_greedy(loaded, plan, params)[0]


@pytest.mark.skipif(not bf16_kernel.supported(), reason="this CPU lacks AVX512-BF16")
def test_fused_layers_run_the_checkpoint_blocks_side_by_side(bf16_kernels):
    """A fused bf16 model (q|k|v and gate|up joined) with a checkpoint's int4 blocks computes what the
    unfused model with the same blocks computes. The blocks come from other weights than the model's,
    so a layer that quantized its own float weight instead would not match."""
    tokenizer = make_test_tokenizer()
    other = _fusable_model(len(tokenizer), seed=1)
    blocks = {name: Int4Blocks.of(module.weight, torch.bfloat16) for name, module in other.named_modules()
              if isinstance(module, torch.nn.Linear) and name != "lm_head"}
    plain, fused = (wrap_model(_fusable_model(len(tokenizer), seed=0), tokenizer, name="d64", fuse_layers=fuse,
                               weights=WeightFormat.INT4, blocks=blocks, pack_weights=True) for fuse in (False, True))
    attention = fused.model.model.layers[0].self_attn
    assert isinstance(attention, FusedAttention) and isinstance(attention.qkv_proj, Int4Linear)
    ids = list(range(3, 80))
    positions = list(range(len(ids)))
    want = full_prefill_logits(plain.model, ids, positions).float()
    got = full_prefill_logits(fused.model, ids, positions).float()
    assert (got - want).abs().max().item() <= 0.05  # what fusion alone moves bf16 logits by (test_fused_layers)
    unquantized = full_prefill_logits(wrap_model(_fusable_model(len(tokenizer), seed=0), tokenizer, name="d64").model,
                                      ids, positions).float()
    assert (unquantized - want).abs().max().item() > 1.0  # the blocks, not the model's own weights, were used


def _fusable_model(vocab_size: int, seed: int) -> torch.nn.Module:
    """A bf16 Llama with head dim 64 and GQA, the shapes the fused kernels take."""
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()


def test_model_config_and_settings_take_the_weights_choice(monkeypatch):
    from promptcache import cli
    from promptcache.server.settings import ServerSettings

    assert ServerSettings().load_config().weights is WeightFormat.AUTO  # int4 for a 4-bit GGUF (test_gguf_blocks)
    assert ModelConfig().weights is WeightFormat.NATIVE  # the library's default: the model as loaded
    assert ServerSettings(weights="int4").load_config().weights is WeightFormat.INT4
    assert ServerSettings(weights="native").load_config().weights is WeightFormat.NATIVE
    monkeypatch.setenv("PROMPTCACHE_WEIGHTS", "int8")
    assert ServerSettings().load_config().weights is WeightFormat.INT8
    with pytest.raises(ValueError):
        ServerSettings(weights="int3")
    with pytest.raises(ValueError, match="CPU only"):
        ModelConfig(device="cuda", weights=WeightFormat.INT4)
    ModelConfig(device="cuda", weights=WeightFormat.AUTO)  # resolves to native there
    seen = []

    def encode(args) -> int:
        seen.append(ServerSettings(**cli._overrides(args)))
        return 0

    monkeypatch.setattr(cli, "_encode", encode)
    assert cli.main(["encode", "--weights", "int4", "schema.pml"]) == 0
    assert seen[0].load_config().weights is WeightFormat.INT4  # the flag wins over the environment


def _answer(loaded, max_tokens: int) -> list[int]:
    """Greedy tokens the engine answers AMAZON_PROMPT with (its document reused from the store)."""
    runtime = ModelRuntime(loaded, build_store(StoreConfig(), device="cpu"))
    runtime.add_schema(runtime.parse_schema(AMAZON_SCHEMA))
    return _serve(runtime, runtime.plan(AMAZON_PROMPT), SamplingParams(max_tokens=max_tokens, temperature=0))


def _serve(runtime: ModelRuntime, plan, params: SamplingParams) -> list[int]:
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None))

    async def run() -> list[int]:
        tokens = []
        async for event in engine.submit(plan, params):
            assert event.report is None or event.report.error is None, event.report
            if event.token_id is not None:
                tokens.append(event.token_id)
        return tokens

    try:
        return asyncio.run(run())
    finally:
        engine.stop()
