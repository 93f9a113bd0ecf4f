"""The AVX2 fp32 kernels (model_runtime/avx2/csrc/) against plain arithmetic: the int4 product against gguf's own
dequantize and a float64 matmul, the decode batch against float64 softmax attention over the concatenated KV, the
layer ops against the HF modules (RoPE bit for bit), and a tiny model served through all of them against HF's forward.
Skipped on CPUs without AVX2/FMA/F16C; a CPU that has them and a compiler must build the library."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from promptcache.model_runtime import avx2
from promptcache.model_runtime.attention import decode_batch
from promptcache.model_runtime.loading import quantized_linear
from promptcache.model_runtime.loading.architectures import ARCHITECTURES
from promptcache.model_runtime.loading.fused_layers import FusedGatedMLP, FusedRMSNorm
from promptcache.model_runtime.loading.gguf_weights import read_layers, read_q8_0_head
from promptcache.model_runtime.loading.quantized_linear import (
    HEAD,
    INT4_KERNEL_ROWS,
    Int4Blocks,
    Int4Linear,
    WeightFormat,
)
from promptcache.model_runtime.loading.stored_linear import INT8_BLOCK_ROWS, Int8BlockLinear, head_layer
from tests.model_runtime.test_int4_bf16_kernel import _write_gguf
from tests.model_runtime.test_torch_layer_ops import assert_rope_matches_hf

pytestmark = pytest.mark.usefixtures("avx2_kernels")


def _product_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """fp32 sums in another order than a float64 matmul: ~1e-6 of the largest output."""
    return (got.double() - want.double()).abs().max().item() <= 2e-6 * want.abs().max().item()


@pytest.mark.parametrize("num_rows", [1, 3, 4, 5, 9])
def test_int4_product_of_a_q4_1_file_equals_ggufs_dequantized_weight(tmp_path, num_rows):
    """SmolLM2's Q4_1 blocks read from a file multiply as gguf's dequantize of the same tensor, fp16 scales held."""
    weight = np.random.default_rng(0).standard_normal((96, 256)).astype(np.float32) * 0.05
    writer = GGUFWriter(tmp_path / "m.gguf", "llama")
    writer.add_uint32("llama.attention.head_count", 4)
    writer.add_uint32("llama.attention.head_count_kv", 2)
    stored = quantize(weight, GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.ffn_down.weight", stored, raw_shape=stored.shape, raw_dtype=GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    blocks = read_layers(tmp_path / "m.gguf", 4, 2).blocks["model.layers.0.mlp.down_proj"]
    want_weight = torch.from_numpy(dequantize(stored, GGMLQuantizationType.Q4_1).copy())
    ops = avx2.int4_ops()
    assert ops is not None
    packed = ops.pack(blocks.values, blocks.scales, blocks.minimums)
    assert packed[1].dtype == packed[2].dtype == torch.float16  # Q4_1's own fp16 d and m, as stored
    x = torch.randn(num_rows, 256, generator=torch.Generator().manual_seed(num_rows))
    got = ops.mm(x, *packed)
    assert got.shape == (num_rows, 96) and _product_close(got, x.double() @ want_weight.double().T)


@pytest.mark.parametrize("out_features,in_features", [(8, 32), (40, 64), (3072, 576), (576, 1536)])
def test_int4_product_with_fp32_scales_at_many_shapes(out_features, in_features):
    """Blocks whose scales are not fp16 values keep fp32 ones; every pass width and row count (1..4 in registers,
    then more passes) against float64."""
    generator = torch.Generator().manual_seed(out_features)
    blocks = Int4Blocks.of(torch.randn(out_features, in_features, generator=generator) * 0.1, torch.float32)
    ops = avx2.int4_ops()
    assert ops is not None
    packed = ops.pack(blocks.values, blocks.scales, blocks.minimums)
    assert packed[1].dtype == torch.float32
    for num_rows in (1, 2, 3, 4, 6, 13):
        x = torch.randn(num_rows, in_features, generator=generator)
        assert _product_close(ops.mm(x, *packed), x.double() @ blocks.dequantized().double().T)


def test_int4_linear_in_fp32_runs_the_kernel_below_its_rows(monkeypatch):
    linear = torch.nn.Linear(576, 960).requires_grad_(False)
    blocks = Int4Blocks.of(linear.weight, torch.float32)
    layer = Int4Linear(blocks, linear.bias, torch.float32)
    assert layer.kernel_values is not None and "kernel_values" not in layer.state_dict()
    ops, calls = avx2.int4_ops(), []
    assert ops is not None

    def counted_mm(*args: torch.Tensor) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return ops.mm(*args)

    monkeypatch.setattr(avx2, "int4_ops", lambda: quantized_linear.Int4Ops(ops.pack, counted_mm))
    for num_rows in (1, 7, INT4_KERNEL_ROWS[torch.float32] - 1, INT4_KERNEL_ROWS[torch.float32]):
        x = torch.randn(1, num_rows, 576)
        want = x.double() @ blocks.dequantized().double().T + linear.bias.double()
        assert _product_close(layer(x), want)
    assert calls == [1, 7, INT4_KERNEL_ROWS[torch.float32] - 1]  # the last: the dequantized copy
    assert quantized_linear.int4_is_fast(torch.float32)


def _attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float):
    """float64 softmax attention of q [H, D] over the concatenated keys/values [H_kv, n, D]: (out [H, D], lse [H])."""
    group = q.shape[0] // keys[0].shape[0]
    k = torch.cat(keys, 1).double().repeat_interleave(group, 0)  # [H, N, D]
    v = torch.cat(values, 1).double().repeat_interleave(group, 0)
    scores = torch.einsum("hd,hnd->hn", q.double(), k) * scale
    return torch.einsum("hn,hnd->hd", scores.softmax(-1), v), scores.logsumexp(-1)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (8, 2, 64)])
def test_decode_batch_equals_attention_over_each_sequences_kv(heads, kv_heads, dim):
    """Ragged own KV (none, a partial key step, hundreds) in views of larger buffers, segments shared by several
    sequences and segments of one, against float64 attention over each sequence's keys in order."""
    generator = torch.Generator().manual_seed(heads * dim)
    layers, capacity = 2, 512

    def kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:  # [L, H_kv, n, D] views with a padded row stride
        full = torch.randn(2, layers, kv_heads, n, dim + 8, generator=generator)
        return full[0, ..., :dim], full[1, ..., :dim]

    own_lens = [5, 0, 300]
    own = [kv(capacity) for _ in own_lens]
    segments = [(*kv(37), [0, 1, 2]), (*kv(1000), [2]), (*kv(3), [0, 1]), (*kv(0), [0])]
    batch = avx2.decode_batch_type()([k for k, _ in own], [v for _, v in own], own_lens, [s[0] for s in segments],
                                     [s[1] for s in segments], [s[2] for s in segments])
    scale = dim ** -0.5
    for layer in range(layers):
        q = torch.randn(len(own_lens), heads, dim + 4, generator=generator)[..., :dim]  # strided rows
        out, lse = batch.attend(q, layer, scale)
        for seq, n in enumerate(own_lens):
            seen = [s for s in segments if seq in s[2]]
            want_out, want_lse = _attention(q[seq], [s[0][layer] for s in seen] + [own[seq][0][layer, :, :n]],
                                            [s[1][layer] for s in seen] + [own[seq][1][layer, :, :n]], scale)
            assert (out[seq].double() - want_out).abs().max().item() <= 2e-6
            assert (lse[seq].double() - want_lse).abs().max().item() <= 2e-5


def test_decode_batch_refuses_what_it_cannot_attend():
    k = torch.zeros(1, 2, 4, 64)
    with pytest.raises(RuntimeError, match="has no keys"):
        avx2.decode_batch_type()([k], [k], [0], [], [], [])
    with pytest.raises(RuntimeError, match="float32"):
        avx2.decode_batch_type()([k.bfloat16()], [k.bfloat16()], [4], [], [], [])
    batch = avx2.decode_batch_type()([k], [k], [4], [], [], [])
    with pytest.raises(RuntimeError, match="layer 1 of 1"):
        batch.attend(torch.zeros(1, 4, 64), 1, 0.125)
    assert decode_batch.kernel_takes(torch.float32, torch.device("cpu"), 64, [1, 1], "auto")
    assert not decode_batch.kernel_takes(torch.float32, torch.device("cpu"), 64, [1, 2], "auto")
    assert not decode_batch.kernel_takes(torch.float32, torch.device("cpu"), 64, [1], "matmul")


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128)])
def test_rope_matches_apply_rotary_pos_emb_bit_for_bit(heads, kv_heads, dim):
    ops = avx2.fused_ops()
    assert ops is not None
    assert_rope_matches_hf(ops.rope_qk, heads, kv_heads, dim, torch.float32)


def test_rms_norm_and_mlp_match_the_llama_modules():
    ops = avx2.fused_ops()
    assert ops is not None
    generator = torch.Generator().manual_seed(3)
    norm = LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=generator))
    from transformers import LlamaConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        mlp = LlamaMLP(LlamaConfig(hidden_size=576, intermediate_size=1536))
    x = torch.randn(2, 41, 576, generator=generator) * 3
    with torch.inference_mode():
        for fused, plain in ((FusedRMSNorm(norm, ops), norm), (FusedGatedMLP(mlp, ops, ARCHITECTURES["llama"]), mlp)):
            got, want = fused(x), plain(x)
            assert got.dtype == want.dtype == torch.float32
            assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-6


def test_a_model_served_through_the_kernels_generates_as_hf_with_its_dequantized_weights(monkeypatch):
    """The serve path on an AVX2 CPU: fused layers on the fp32 ops, int4 weights through the kernel, decode steps
    through one DecodeBatch; batched greedy tokens and logprobs equal HF's forward of the same (dequantized) weights."""
    import copy

    from promptcache.cache_store import StoreConfig, build_store
    from promptcache.model_runtime import ModelRuntime, WeightFormat, wrap_model
    from promptcache.model_runtime.engine import Fidelity
    from promptcache.model_runtime.loading.fused_layers import FusedAttention
    from tests.model_factories import make_test_tokenizer
    from tests.model_runtime.batched_generation import assert_batched_generation_equals_hf
    from tests.model_runtime.test_fidelity import PROMPTS, SCHEMA
    from tests.model_runtime.test_torch_layer_ops import _model

    tokenizer = make_test_tokenizer()
    served = _model("llama", len(tokenizer), torch.float32)
    with torch.no_grad():  # 4-bit representable weights: the oracle multiplies exactly what the kernel does
        for module in served.modules():
            if type(module) is torch.nn.Linear and module is not served.lm_head:
                module.weight.copy_(Int4Blocks.of(module.weight, torch.float32).dequantized())
    oracle = copy.deepcopy(served)
    calls = {"attend": 0, "int4": 0}
    batch_type, ops = avx2.decode_batch_type(), avx2.int4_ops()
    assert ops is not None

    class CountedBatch:
        def __init__(self, *args):
            self.batch = batch_type(*args)

        def attend(self, q, layer, scale):
            calls["attend"] += 1
            return self.batch.attend(q, layer, scale)

    def counted_mm(*args: torch.Tensor) -> torch.Tensor:
        calls["int4"] += 1
        return ops.mm(*args)

    monkeypatch.setattr(avx2, "decode_batch_type", lambda: CountedBatch)
    monkeypatch.setattr(avx2, "int4_ops", lambda: quantized_linear.Int4Ops(ops.pack, counted_mm))
    loaded = wrap_model(served, tokenizer, name="d64-int4", fuse_layers=True, weights=WeightFormat.INT4)
    assert isinstance(served.model.layers[0].self_attn, FusedAttention)
    assert isinstance(served.model.layers[0].self_attn.qkv_proj, Int4Linear)
    runtime = ModelRuntime(loaded, build_store(StoreConfig()))
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    assert_batched_generation_equals_hf(runtime, oracle, PROMPTS, num_tokens=8, fidelity=Fidelity("exact"))
    assert calls["attend"] > 0 and calls["int4"] > 0


def _write_q8_0_head(path, weight: np.ndarray) -> np.ndarray:
    return _write_gguf(path, "token_embd.weight", weight, GGMLQuantizationType.Q8_0)


@pytest.mark.parametrize("num_rows", [1, 3, 6])
def test_a_q8_0_head_multiplies_the_files_bytes_in_fp32(tmp_path, monkeypatch, num_rows):
    """The tied embedding's Q8_0 blocks multiply through the int8 product (one pass over the file's bytes) as gguf's
    dequantize of the file gives them; from INT8_BLOCK_ROWS rows a dequantized copy, the same weights."""
    weight = np.random.default_rng(1).standard_normal((96, 128)).astype(np.float32) * 0.05
    stored = _write_q8_0_head(tmp_path / "m.gguf", weight)
    want_weight = torch.from_numpy(dequantize(stored, GGMLQuantizationType.Q8_0).copy()).double()
    ops, calls = avx2.int8_ops(), []
    assert ops is not None

    def counted_mm(*args: torch.Tensor) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return ops.mm(*args)

    monkeypatch.setattr(avx2, "int8_ops", lambda: avx2.kernels.Int8Ops(ops.pack, counted_mm))
    blocks = read_q8_0_head(tmp_path / "m.gguf")[HEAD]
    head = head_layer(blocks, torch.float32)
    assert isinstance(head, Int8BlockLinear) and head.block_scales.dtype == torch.float16  # Q8_0's own fp16 d
    assert torch.equal(head.blocks().values, blocks.values) and torch.equal(head.blocks().scales, blocks.scales)
    for rows in (num_rows, INT8_BLOCK_ROWS):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
        assert _product_close(head(x), x.double() @ want_weight.T)
    assert calls == [num_rows]


def test_auto_serves_a_native_ggufs_exact_blocks_as_stored_in_fp32(tmp_path):
    """A GGUF served native (Gemma 3 270M's mix: Q5_0, Q8_0, Q4_K and Q6_K layers) multiplies, under auto in fp32,
    every layer whose blocks widen to fp32 exactly from the file's blocks (Q5_0, Q8_0 and Q6_K: the int8 product, Q6_K
    in 16-input groups; Q4_K: the int4 one), each the very weight transformers loads; the model computes the widened
    model's logits. Not with --weights native; a Q8_0 head likewise. (In bf16, where widening rounds otherwise, the bf16
    kernels serve them: test_gguf_blocks.py.)"""
    from transformers import AutoModelForCausalLM

    from promptcache.model_runtime.loading import stored_weights
    from promptcache.model_runtime.loading.stored_linear import quantize_linears
    from tests.model_runtime.test_gguf_blocks import HEADS, KV_HEADS, Q, _hf_weights, write_llama_gguf

    kinds = {"attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "ffn_gate": Q.Q5_0, "ffn_up": Q.Q5_0,
             "ffn_down": Q.Q6_K}  # attn_output: Q4_K
    stored = write_llama_gguf(tmp_path / "m.gguf", kinds)
    _write_q8_0_head(tmp_path / "h.gguf", np.random.default_rng(5).standard_normal((64, 64)).astype(np.float32))

    def choose(requested: WeightFormat, dtype: torch.dtype, path=tmp_path / "m.gguf"):
        return stored_weights.choose(requested, path, HEADS, KV_HEADS, device="cpu", dtype=dtype, deterministic=False)

    auto = choose(WeightFormat.AUTO, torch.float32)
    assert auto.weights is WeightFormat.NATIVE and "exact" in auto.reason
    assert set(auto.blocks) == {f"model.layers.0.{name}" for name in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
        "mlp.down_proj")}
    assert not choose(WeightFormat.NATIVE, torch.float32).blocks
    assert "exact" not in choose(WeightFormat.AUTO, torch.bfloat16).reason
    assert set(choose(WeightFormat.AUTO, torch.float32, tmp_path / "h.gguf").blocks) == {HEAD}

    widened = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    assert quantize_linears(model, auto.weights, auto.blocks) == 7
    modules = dict(model.named_modules())
    for name, want in _hf_weights(stored).items():
        layer = modules[name]
        if isinstance(layer, Int8BlockLinear):
            got = layer.blocks().dequantized()
            assert layer.blocks().group == (16 if name.endswith("down_proj") else 32), name  # Q6_K's sub-blocks
        else:
            assert isinstance(layer, Int4Linear), name
            got = layer.dequantized_t().t()
        assert torch.equal(got + 0.0, want + 0.0), name  # the same bits (+ 0.0: a -0.0 of d * 0)
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(ids).logits, widened(ids).logits
        got_row, want_row = model(ids[:, :1]).logits, widened(ids[:, :1]).logits  # the kernels' decode row
    for g, w in ((got, want), (got_row, want_row)):
        assert (g - w).abs().max().item() <= 1e-5 * w.abs().max().item()  # summation order only


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 7, 8])
def test_int8_product_of_q6_k_sub_blocks_equals_ggufs_dequantized_weight(num_rows):
    """Q6_K's 16-input groups through the int8 product (fp32 scales: d * sc is not an fp16) equal gguf's dequantize
    of the same bytes; from INT8_BLOCK_ROWS rows the dequantized copy, the same weight."""
    from promptcache.model_runtime.loading.gguf_blocks import q6_k_blocks
    from tests.model_runtime.test_gguf_blocks import Q, wide_raw

    raw = wide_raw(np.random.default_rng(3), Q.Q6_K, 40, 512)
    want_weight = torch.from_numpy(dequantize(raw, Q.Q6_K).copy()).double()
    layer = Int8BlockLinear(q6_k_blocks(raw), None)
    assert layer.block_scales.shape == (5, 32, 8)
    for rows in (num_rows, INT8_BLOCK_ROWS):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        assert _product_close(layer(x), x.double() @ want_weight.T), rows


def test_8_bit_layer_blocks_are_refused_where_their_product_does_not_run():
    """A layer's Int8Blocks multiply in fp32 (and bf16 with the bf16 kernels) only: an fp16 model given them is refused,
    not served fp32 outputs."""
    from promptcache.model_runtime.errors import ModelLoadError
    from promptcache.model_runtime.loading.stored_linear import Int8Blocks, quantize_linears

    model = torch.nn.Sequential(torch.nn.Linear(64, 16, bias=False)).to(torch.float16)
    blocks = {"0": Int8Blocks(torch.randint(-128, 128, (16, 64), dtype=torch.int8), torch.rand(16, 2))}
    with pytest.raises(ModelLoadError, match="float16"):
        quantize_linears(model, WeightFormat.NATIVE, blocks)
    model = torch.nn.Sequential(torch.nn.Linear(64, 16, bias=False))
    assert quantize_linears(model, WeightFormat.NATIVE, blocks) == 1 and isinstance(model[0], Int8BlockLinear)
    x = torch.randn(3, 64)
    torch.testing.assert_close(model(x), x @ blocks["0"].dequantized().T, rtol=1e-5, atol=1e-5)
