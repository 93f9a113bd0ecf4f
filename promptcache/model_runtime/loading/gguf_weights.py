"""The 4-bit (Q4_1) and 8-bit (Q8_0) blocks of a Llama-family GGUF checkpoint, read as stored, named as the
Hugging Face model names them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from promptcache.model_runtime.errors import ModelLoadError
from promptcache.model_runtime.loading.quantized_linear import GROUP_SIZE, HEAD, Int4Blocks

# GGUF tensor -> HF module (llama.cpp's names for the Llama family; transformers maps them the same way)
_MODULES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_BLOCK_BYTES = 4 + GROUP_SIZE // 2  # fp16 d, fp16 m, 32 nibbles
_Q8_0_BLOCK_BYTES = 2 + GROUP_SIZE  # fp16 d, 32 int8


def read_q4_1(path: str | Path, num_heads: int, num_kv_heads: int) -> dict[str, Int4Blocks]:
    """The decoder layers' Q4_1 tensors in the GGUF at `path` by HF module name (`model.layers.3.mlp.up_proj`), q and k
    rows in HF order (llama.cpp interleaves each head's halves for RoPE). Raises ModelLoadError if it cannot be read."""
    from gguf import GGMLQuantizationType

    blocks: dict[str, Int4Blocks] = {}
    for tensor in _tensors(path).values():
        match = _LAYER_TENSOR.fullmatch(tensor.name)
        if tensor.tensor_type != GGMLQuantizationType.Q4_1 or match is None or match[2] not in _MODULES:
            continue
        layer = _blocks(np.asarray(tensor.data))
        if match[2] in ("attn_q", "attn_k"):
            layer = _unpermuted(layer, num_heads if match[2] == "attn_q" else num_kv_heads)
        blocks[f"model.layers.{match[1]}.{_MODULES[match[2]]}"] = layer
    return blocks


def read_q8_0_head(path: str | Path) -> dict[str, Int4Blocks]:
    """The output head's Q8_0 blocks (`output.weight`, else the tied `token_embd.weight`) keyed HEAD, as one int4
    layer over the input written twice (`SplitByteLinear`); empty when stored otherwise. q = d * (16 h + l - 128)
    (h, l: q + 128's nibbles) splits into groups of scale 16 d, minimum -128 d and of scale d, minimum 0."""
    from gguf import GGMLQuantizationType

    tensors = _tensors(path)
    tensor = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if tensor is None or tensor.tensor_type != GGMLQuantizationType.Q8_0:
        return {}
    data = torch.from_numpy(np.asarray(tensor.data).copy())
    out_features = data.shape[0]
    data = data.view(out_features, -1, _Q8_0_BLOCK_BYTES)  # [out, in / G, 34]
    d = data[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()  # [out, in / G]
    biased = (data[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)  # [out, in / G, G]
    values = torch.cat([(biased >> 4).reshape(out_features, -1), (biased & 0x0F).reshape(out_features, -1)], dim=1)
    scales = torch.cat([16 * d, d], dim=1)  # [out, 2 in / G]
    minimums = torch.cat([-128 * d, torch.zeros_like(d)], dim=1)
    return {HEAD: Int4Blocks(values, scales, minimums)}


def _tensors(path: str | Path) -> dict[str, Any]:
    """The file's tensors by GGUF name (memory-mapped). Raises ModelLoadError when it cannot be read."""
    from gguf import GGUFReader

    try:
        return {tensor.name: tensor for tensor in GGUFReader(path).tensors}
    except Exception as exc:
        raise ModelLoadError(f"cannot read the GGUF file {path}: {exc}") from None


def _blocks(raw: np.ndarray) -> Int4Blocks:
    """Q4_1 bytes [out, in / 32 * 20] -> Int4Blocks (a block: fp16 d, fp16 m, nibbles of values 0..15 | 16..31)."""
    data = torch.from_numpy(raw.copy())
    out_features = data.shape[0]
    data = data.view(out_features, -1, _BLOCK_BYTES)  # [out, in / G, 20]
    scales = data[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()  # [out, in / G]
    minimums = data[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    nibbles = data[..., 4:]  # [out, in / G, 16]
    values = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(out_features, -1)  # [out, in]
    return Int4Blocks(values, scales, minimums)


def _unpermuted(blocks: Int4Blocks, num_heads: int) -> Int4Blocks:
    """Rows of each head from llama.cpp's interleaved pairs [head_dim / 2, 2] back to HF's halves [2, head_dim / 2]."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        head_dim = t.shape[0] // num_heads
        return t.reshape(num_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(t.shape)
    return Int4Blocks(rows(blocks.values), rows(blocks.scales), rows(blocks.minimums))
