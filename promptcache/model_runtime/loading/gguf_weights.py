"""A Llama-family GGUF checkpoint's 4-bit (Q4_0, Q4_1, Q4_K: gguf_blocks.py) and 8-bit head (Q8_0) blocks, read as
stored, named as the Hugging Face model names them; which layers it stores in more bits."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from promptcache.model_runtime.errors import ModelLoadError
from promptcache.model_runtime.loading.gguf_blocks import q4_0_blocks, q4_1_blocks, q4_k_blocks
from promptcache.model_runtime.loading.quantized_linear import GROUP_SIZE, HEAD, Int4Blocks

# GGUF tensor -> HF module (llama.cpp's names for the Llama family; transformers maps them the same way)
_MODULES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
# The 4-bit block types, as Int4Blocks; any other type of a projection is "wider"
_READERS: dict[GGMLQuantizationType, Callable[[np.ndarray], Int4Blocks]] = {
    GGMLQuantizationType.Q4_0: q4_0_blocks, GGMLQuantizationType.Q4_1: q4_1_blocks,
    GGMLQuantizationType.Q4_K: q4_k_blocks}
_Q8_0_BLOCK_BYTES = 2 + GROUP_SIZE  # fp16 d, 32 int8
# The model types (as transformers loads the GGUF) whose tensors `read_layers` names and lays out as transformers does:
# llama.cpp's Llama family, q and k rows interleaved for its RoPE. Others (Gemma 3: q and k not interleaved) are not
# read: int4 is refused for them and auto serves them native, before the file's 262K-entry vocabulary is parsed.
BLOCK_ARCHITECTURES = frozenset({"llama"})


@dataclass(frozen=True, slots=True)
class GGUFLayers:
    """A GGUF file's decoder projections by HF module name (`model.layers.3.mlp.up_proj`): the 4-bit ones (Q4_0,
    Q4_1, Q4_K) as stored blocks, q and k rows in HF order; `wider`: the rest (Q5_K, Q6_K, Q8_0, F16 ...), which
    int4 serving keeps as loaded (dequantized to the serving dtype), never re-quantized to fewer bits."""

    blocks: dict[str, Int4Blocks]
    wider: frozenset[str]


def read_layers(path: str | Path, num_heads: int, num_kv_heads: int) -> GGUFLayers:
    """The decoder projections of the GGUF at `path` (llama.cpp interleaves q's and k's head halves for RoPE; undone
    here as transformers' loader undoes it). Raises ModelLoadError if it cannot be read."""
    blocks: dict[str, Int4Blocks] = {}
    wider: set[str] = set()
    for tensor in _tensors(path).values():
        if (name := _hf_name(tensor.name)) is None:
            continue
        read = _READERS.get(tensor.tensor_type)
        if read is None:
            wider.add(name)
            continue
        layer = read(np.asarray(tensor.data))
        if tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            layer = _unpermuted(layer, num_heads if "attn_q" in tensor.name else num_kv_heads)
        blocks[name] = layer
    return GGUFLayers(blocks, frozenset(wider))


def is_4bit(path: str | Path) -> bool:
    """Whether most of the decoder projections' weights in the GGUF at `path` are stored in a 4-bit block type
    (Q4_0, Q4_1, Q4_K: a Q4_K_M file's Q6_K layers are the minority). Raises ModelLoadError if it cannot be read."""
    counts = {True: 0, False: 0}
    for tensor in _tensors(path).values():
        if _hf_name(tensor.name) is not None:
            counts[tensor.tensor_type in _READERS] += int(tensor.n_elements)
    return counts[True] > counts[False]


def read_q8_0_head(path: str | Path) -> dict[str, Int4Blocks]:
    """The output head's Q8_0 blocks (`output.weight`, else the tied `token_embd.weight`) keyed HEAD, as one int4
    layer over the input written twice (`SplitByteLinear`); empty when stored otherwise. q = d * (16 h + l - 128)
    (h, l: q + 128's nibbles) splits into groups of scale 16 d, minimum -128 d and of scale d, minimum 0."""
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


def _hf_name(gguf_name: str) -> str | None:
    """`blk.3.ffn_up.weight` -> `model.layers.3.mlp.up_proj`; None for any other tensor."""
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _MODULES:
        return None
    return f"model.layers.{match[1]}.{_MODULES[match[2]]}"


def _unpermuted(blocks: Int4Blocks, num_heads: int) -> Int4Blocks:
    """Rows of each head from llama.cpp's interleaved pairs [head_dim / 2, 2] back to HF's halves [2, head_dim / 2]."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        head_dim = t.shape[0] // num_heads
        return t.reshape(num_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(t.shape)
    return Int4Blocks(rows(blocks.values), rows(blocks.scales), rows(blocks.minimums))
