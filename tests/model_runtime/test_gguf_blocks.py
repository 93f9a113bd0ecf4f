"""GGUF block types (loading/gguf_blocks.py, gguf_weights.py) and the weight format a file is served in
(loading/stored_weights.py).

Oracle: the `gguf` package's own `dequantize` (and its `quantize` where it has one: Q4_0, Q4_1, Q8_0); the K-quants it
cannot quantize are built here byte by byte from ggml's block_q4_K / block_q5_K / block_q6_K and checked against the
formula they encode. Transformers' GGUF loader (gguf's dequantize plus its q/k row permutation) loads the same files.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from promptcache.model_runtime import WeightFormat
from promptcache.model_runtime.attention import bf16_kernel
from promptcache.model_runtime.loading import quantized_linear, stored_weights
from promptcache.model_runtime.loading.gguf_blocks import q4_0_blocks, q4_1_blocks, q4_k_blocks, q6_k_blocks
from promptcache.model_runtime.loading.gguf_weights import is_4bit, read_layers
from promptcache.model_runtime.loading.quantized_linear import Int4Linear
from promptcache.model_runtime.loading.stored_linear import (
    HEAD,
    Int8BlockLinear,
    Int8Blocks,
    head_layer,
    quantize_linears,
)

Q = GGMLQuantizationType
HEADS, KV_HEADS, HIDDEN, FFN = 4, 2, 256, 512  # head_dim 64; every input width a whole Q4_K super-block


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)[..., None].view(np.uint8)  # [..., 2]


def q4_k_raw(rng: np.random.Generator, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Random Q4_K bytes [rows, cols / 256 * 144] as ggml's block_q4_K lays them out, and the weight they encode
    (d * sc * q - dmin * m in fp32, computed here from the parts)."""
    num_super = cols // 256
    d, dmin = (rng.uniform(1e-4, 2e-3, (rows, num_super)).astype(np.float16) for _ in range(2))
    sc, m = (rng.integers(0, 64, (rows, num_super, 8), dtype=np.uint8) for _ in range(2))
    sc[0, 0], m[0, 0] = 63, 63  # the 6-bit extremes
    q = rng.integers(0, 16, (rows, num_super, 8, 32), dtype=np.uint8)  # [rows, super, sub-block, 32]
    scales = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)], axis=-1)  # [rows, super, 12]
    pairs = q.reshape(rows, num_super, 4, 2, 32)
    nibbles = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(rows, num_super, 128)
    raw = np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), scales, nibbles], axis=-1)  # [rows, super, 144]
    weight = (d.astype(np.float32)[..., None] * sc.astype(np.float32))[..., None] * q.astype(np.float32) \
        - (dmin.astype(np.float32)[..., None] * m.astype(np.float32))[..., None]
    return raw.reshape(rows, -1), weight.reshape(rows, cols)


def wide_raw(rng: np.random.Generator, kind: Q, rows: int, cols: int) -> np.ndarray:
    """Q5_K (block_q5_K: d, dmin, 12 scale bytes, qh[32], qs[128]) or Q6_K (ql[128], qh[64], int8 scales[16], d)
    bytes: any bits are valid blocks once the fp16 fields are finite."""
    num_super, block_bytes = cols // 256, {Q.Q5_K: 176, Q.Q6_K: 210}[kind]
    raw = rng.integers(0, 256, (rows, num_super, block_bytes), dtype=np.uint8)
    d = _fp16_bytes(rng.uniform(1e-4, 1e-3, (rows, num_super, 2 if kind is Q.Q5_K else 1)))
    if kind is Q.Q5_K:
        raw[..., 0:4] = d.reshape(rows, num_super, 4)
    else:
        raw[..., 208:210] = d.reshape(rows, num_super, 2)
    return raw.reshape(rows, -1)


def test_q4_k_blocks_are_gguf_dequantize_bit_for_bit():
    raw, weight = q4_k_raw(np.random.default_rng(0), 48, 512)
    want = dequantize(raw, Q.Q4_K)
    np.testing.assert_array_equal(want, weight)  # the bytes say what ggml's layout means
    blocks = q4_k_blocks(raw)
    assert blocks.scales.shape == (48, 512 // 32)  # one group per sub-block
    got = blocks.dequantized().numpy()
    assert np.array_equal(got.view(np.int32), want.view(np.int32))  # the same bits, not only close


def test_q6_k_blocks_are_gguf_dequantize_bit_for_bit():
    """Q6_K as 8-bit blocks of 16 inputs: `d * sc` times `q - 32` is gguf's dequantize bit for bit (any bytes)."""
    raw = wide_raw(np.random.default_rng(7), Q.Q6_K, 24, 512)
    raw.reshape(24, 2, 210)[0, 0, 192:208] = np.array([127, 128, 0, 1] * 4, dtype=np.uint8)  # int8 scale extremes
    want = torch.from_numpy(dequantize(raw, Q.Q6_K).copy())
    blocks = q6_k_blocks(raw)
    assert blocks.group == 16 and blocks.values.dtype == torch.int8
    assert int(blocks.values.min()) >= -32 and int(blocks.values.max()) <= 31
    assert torch.equal(blocks.dequantized() + 0.0, want + 0.0)


@pytest.mark.parametrize(("kind", "read"), [(Q.Q4_0, q4_0_blocks), (Q.Q4_1, q4_1_blocks)])
def test_q4_0_and_q4_1_blocks_are_gguf_dequantize_bit_for_bit(kind, read):
    weight = np.random.default_rng(1).standard_normal((32, 256)).astype(np.float32) * 0.05
    raw = quantize(weight, kind)
    want = dequantize(raw, kind)
    got = read(raw).dequantized().numpy()
    assert np.array_equal(got + 0.0, want + 0.0)  # + 0.0: Q4_0's d * 0 may be -0.0 where ours is +0.0


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_int4_linear_multiplies_by_the_stored_weight(kind):
    """fp32: the dequantized copy is the file's weight bit for bit; the kernel computes (q - 8) s + (m + 8 s), one
    more rounding of the zero point (within 1e-6 relative)."""
    rng = np.random.default_rng(2)
    if kind is Q.Q4_K:
        raw, _ = q4_k_raw(rng, 64, 256)
    else:
        raw = quantize(rng.standard_normal((64, 256)).astype(np.float32) * 0.05, kind)
    want = torch.from_numpy(dequantize(raw, kind).copy())
    layer = Int4Linear({Q.Q4_0: q4_0_blocks, Q.Q4_1: q4_1_blocks, Q.Q4_K: q4_k_blocks}[kind](raw), None, torch.float32)
    assert layer.can_dequantize and torch.equal(layer.dequantized_t().t() + 0.0, want + 0.0)
    with torch.no_grad():
        kernel_weight = layer(torch.eye(layer.in_features)).t()  # row i of eye picks input i: [out, in]
    torch.testing.assert_close(kernel_weight, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


def _projections(rng: np.random.Generator, kinds: dict[str, Q]) -> dict[str, tuple[np.ndarray, Q]]:
    """One Llama layer's projections as stored bytes of the given types (the rest Q4_K)."""
    shapes = {"attn_q": (HEADS * 64, HIDDEN), "attn_k": (KV_HEADS * 64, HIDDEN), "attn_v": (KV_HEADS * 64, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}
    stored = {}
    for name, (rows, cols) in shapes.items():
        kind = kinds.get(name, Q.Q4_K)
        if kind is Q.Q4_K:
            raw = q4_k_raw(rng, rows, cols)[0]
        elif kind in (Q.Q5_K, Q.Q6_K):
            raw = wide_raw(rng, kind, rows, cols)
        else:
            raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, kind)
        stored[f"blk.0.{name}.weight"] = (raw, kind)
    return stored


def write_llama_gguf(path, kinds: dict[str, Q], embedding: Q = Q.F32) -> dict[str, tuple[np.ndarray, Q]]:
    """A one-layer Llama GGUF transformers can load (config keys, F32 norms, the tied embedding F32 or `embedding`);
    returns the projections."""
    rng = np.random.default_rng(3)
    stored = _projections(rng, kinds)
    writer = GGUFWriter(path, "llama")
    for key, value in [("context_length", 128), ("embedding_length", HIDDEN), ("block_count", 1),
                       ("feed_forward_length", FFN), ("head_count", HEADS), ("head_count_kv", KV_HEADS)]:
        getattr(writer, f"add_{key}")(value)
    writer.add_rope_dimension_count(64)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(64)
    for name, shape in [("token_embd.weight", (64, HIDDEN)), ("output_norm.weight", (HIDDEN,)),
                        ("blk.0.attn_norm.weight", (HIDDEN,)), ("blk.0.ffn_norm.weight", (HIDDEN,))]:
        values = rng.standard_normal(shape).astype(np.float32)
        if name == "token_embd.weight" and embedding is not Q.F32:
            raw = quantize(values, embedding)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=embedding)
        else:
            writer.add_tensor(name, values)
    for name, (raw, kind) in stored.items():
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def _hf_weights(stored: dict[str, tuple[np.ndarray, Q]]) -> dict[str, torch.Tensor]:
    """gguf's dequantize of each projection, q and k rows permuted as transformers' loader permutes them."""
    processor = LlamaTensorProcessor({"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS})
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    return {f"model.layers.0.{names[name.split('.')[2]]}": torch.from_numpy(
        processor.process(dequantize(raw, kind), name).weights.copy()) for name, (raw, kind) in stored.items()}


MIXED = {"attn_k": Q.Q4_0, "attn_v": Q.Q6_K, "ffn_down": Q.Q4_1, "ffn_up": Q.Q5_K, "attn_output": Q.Q8_0}


def test_a_mixed_file_serves_4_bit_layers_as_stored_and_the_rest_dequantized(tmp_path, monkeypatch):
    """Q4_K_M-like: q, gate Q4_K, k Q4_0, down Q4_1 as int4 blocks; v Q6_K, up Q5_K, o Q8_0 kept float as
    transformers dequantizes them. Every served weight is gguf's dequantize of the file's tensor. (Auto as on an
    AVX-512 CPU, where the kernel is vectorized: the blocks are the same on any CPU.)"""
    monkeypatch.setattr(quantized_linear, "int4_is_fast", lambda dtype: True)
    stored = write_llama_gguf(tmp_path / "m.gguf", MIXED)
    assert is_4bit(tmp_path / "m.gguf")  # 4-bit: q, k, gate, down (360,448 weights) vs 229,376
    choice = stored_weights.choose(WeightFormat.AUTO, tmp_path / "m.gguf", HEADS, KV_HEADS, device="cpu",
                                   dtype=torch.float32, deterministic=False)
    assert choice.weights is WeightFormat.INT4
    assert choice.wider == {"model.layers.0.self_attn.v_proj", "model.layers.0.mlp.up_proj",
                            "model.layers.0.self_attn.o_proj"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    assert quantize_linears(model, choice.weights, choice.blocks, choice.wider) == 4  # the head: F32 embedding
    modules = dict(model.named_modules())
    for name, want in _hf_weights(stored).items():
        layer = modules[name]
        if name in choice.wider:
            assert type(layer) is torch.nn.Linear and torch.equal(layer.weight, want), name
        else:
            assert isinstance(layer, Int4Linear) and torch.equal(layer.dequantized_t().t() + 0.0, want + 0.0), name


def test_auto_is_native_unless_the_file_is_mostly_4_bit(tmp_path, monkeypatch):
    """(Its exactly widening blocks aside: test_avx2_kernels.py serves those as stored in fp32.)"""
    monkeypatch.setattr(stored_weights, "exact_blocks_here", lambda device, dtype, deterministic: False)
    wide = {name: Q.Q8_0 for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")}
    write_llama_gguf(tmp_path / "m.gguf", {**wide, "attn_v": Q.Q6_K, "ffn_down": Q.Q5_K})
    assert not is_4bit(tmp_path / "m.gguf")
    for path in (tmp_path / "m.gguf", None):
        choice = stored_weights.choose(WeightFormat.AUTO, path, HEADS, KV_HEADS, device="cpu",
                                       dtype=torch.float32, deterministic=False)
        assert choice.weights is WeightFormat.NATIVE and not choice.blocks


@pytest.mark.skipif(not bf16_kernel.supported(), reason="this CPU lacks AVX512-BF16")
def test_auto_serves_a_native_ggufs_blocks_as_stored_in_bf16(bf16_kernels, tmp_path):
    """A native GGUF in bf16 (Gemma 3 270M's mix: Q5_0, Q8_0, Q4_K and Q6_K layers, a Q8_0 tied head): under auto every
    projection and the head multiply the file's blocks, each 8-bit layer holding gguf's dequantize of its tensor bit for
    bit. The model's logits (a prompt, and decode rows through the kernels) are no further from the fp32 widened
    model's than the bf16 widened model's are; the head's product is within a bf16 rounding of gguf's. Asked for
    native, or deterministic, nothing is served as stored."""
    kinds = {"attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "ffn_gate": Q.Q5_0, "ffn_up": Q.Q5_0,
             "ffn_down": Q.Q6_K}  # attn_output: Q4_K
    stored = write_llama_gguf(tmp_path / "m.gguf", kinds, embedding=Q.Q8_0)
    choice = stored_weights.choose(WeightFormat.AUTO, tmp_path / "m.gguf", HEADS, KV_HEADS, device="cpu",
                                   dtype=torch.bfloat16, deterministic=False)
    assert choice.weights is WeightFormat.NATIVE and "bf16 rounding" in choice.reason, choice.reason
    assert set(choice.blocks) == {HEAD, *_hf_weights(stored)}

    def load(dtype: torch.dtype) -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=dtype).eval()

    exact, widened, model = load(torch.float32), load(torch.bfloat16), load(torch.bfloat16)
    assert quantize_linears(model, choice.weights, choice.blocks, choice.wider) == 8
    modules = dict(model.named_modules())
    for name, want in _hf_weights(stored).items():
        layer = modules[name]
        if name.endswith("o_proj"):
            assert isinstance(layer, Int4Linear), name
            continue
        assert isinstance(layer, Int8BlockLinear) and layer.dtype == torch.bfloat16, name
        assert torch.equal(layer.blocks().dequantized() + 0.0, want + 0.0), name  # + 0.0: a -0.0 of d * 0
    head = model.get_output_embeddings()
    assert isinstance(head, Int8BlockLinear)
    embedding = next(t for t in GGUFReader(tmp_path / "m.gguf").tensors if t.name == "token_embd.weight")
    hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(0)).bfloat16()
    product = hidden.float() @ torch.from_numpy(dequantize(embedding.data, Q.Q8_0).copy()).T
    with torch.no_grad():
        got = head(hidden).float()
    assert bool(((got - product).abs() <= product.abs() * 2.0 ** -8 + 1e-5 * product.abs().max()).all())
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for rows in (ids, ids[:, :1]):  # a prompt of 9 rows, a decode row
            want, ours, theirs = (m(rows).logits.float() for m in (exact, model, widened))
            assert (ours - want).abs().max() <= 2 * (theirs - want).abs().max() + 1e-3 * want.abs().max()
    for requested, deterministic in ((WeightFormat.NATIVE, False), (WeightFormat.AUTO, True)):
        other = stored_weights.choose(requested, tmp_path / "m.gguf", HEADS, KV_HEADS, device="cpu",
                                      dtype=torch.bfloat16, deterministic=deterministic)
        assert other.weights is WeightFormat.NATIVE and not other.blocks


def test_8_bit_blocks_of_shapes_no_product_takes_keep_their_float_weight():
    """A head of a vocabulary not in 16s (GPT-2's 50,257) or a layer of outputs not in the int8 product's blocks keeps
    its float weight instead of failing the load."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 50, bias=False), torch.nn.Linear(50, 20, bias=False))
    odd = {"0": Int8Blocks(torch.randint(-128, 128, (50, 64), dtype=torch.int8), torch.rand(50, 2)),
           HEAD: Int8Blocks(torch.randint(-128, 128, (20, 64), dtype=torch.int8), torch.rand(20, 2))}
    assert head_layer(odd[HEAD], torch.float32) is None
    assert quantize_linears(model, WeightFormat.NATIVE, odd) == 0
    assert all(type(layer) is torch.nn.Linear for layer in model)


def test_auto_is_native_where_int4_cannot_serve(tmp_path):
    write_llama_gguf(tmp_path / "m.gguf", {})
    for device, deterministic in (("cuda", False), ("cpu", True)):
        choice = stored_weights.choose(WeightFormat.AUTO, tmp_path / "m.gguf", HEADS, KV_HEADS, device=device,
                                       dtype=torch.float32, deterministic=deterministic)
        assert choice.weights is WeightFormat.NATIVE, choice.reason
    asked = stored_weights.choose(WeightFormat.NATIVE, tmp_path / "m.gguf", HEADS, KV_HEADS, device="cpu",
                                  dtype=torch.float32, deterministic=False)
    assert asked.weights is WeightFormat.NATIVE  # --weights native still widens


def test_auto_is_native_where_no_int4_product_is_vectorized(tmp_path, monkeypatch):
    write_llama_gguf(tmp_path / "m.gguf", {})
    monkeypatch.setattr(quantized_linear, "int4_is_fast", lambda dtype: False)
    choice = stored_weights.choose(WeightFormat.AUTO, tmp_path / "m.gguf", HEADS, KV_HEADS, device="cpu",
                                   dtype=torch.float32, deterministic=False)
    assert choice.weights is WeightFormat.NATIVE and "AVX-512" in choice.reason
    asked = stored_weights.choose(WeightFormat.INT4, tmp_path / "m.gguf", HEADS, KV_HEADS, device="cpu",
                                  dtype=torch.float32, deterministic=False)
    assert asked.weights is WeightFormat.INT4 and asked.blocks  # --weights int4 still serves the blocks


def test_read_layers_keys_every_projection_once(tmp_path):
    write_llama_gguf(tmp_path / "m.gguf", MIXED)
    layers = read_layers(tmp_path / "m.gguf", HEADS, KV_HEADS)
    assert set(layers.blocks).isdisjoint(layers.wider) and len(layers.blocks) + len(layers.wider) == 7
