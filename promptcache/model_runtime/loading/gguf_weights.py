"""A GGUF checkpoint's 4-bit (Q4_0, Q4_1, Q4_K), 8-bit (Q8_0, Q5_0: gguf_blocks.py) and 8-bit head (Q8_0) blocks,
read as stored, named as the Hugging Face model names them; which layers it stores otherwise."""

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
from promptcache.model_runtime.loading.gguf_blocks import (
    q4_0_blocks,
    q4_1_blocks,
    q4_k_blocks,
    q5_0_blocks,
    q6_k_blocks,
    q8_0_blocks,
)
from promptcache.model_runtime.loading.quantized_linear import HEAD, Int4Blocks
from promptcache.model_runtime.loading.stored_linear import Int8Blocks, StoredBlocks

# GGUF tensor -> HF module (llama.cpp's names, the Llama family's and Gemma 3's alike; transformers maps them so)
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
# The 8-bit ones (read only when asked: `read_layers(int8=True)`), as Int8Blocks
_INT8_READERS: dict[GGMLQuantizationType, Callable[[np.ndarray], Int8Blocks]] = {
    GGMLQuantizationType.Q8_0: q8_0_blocks, GGMLQuantizationType.Q5_0: q5_0_blocks,
    GGMLQuantizationType.Q6_K: q6_k_blocks}
# The model types (as transformers loads the GGUF) whose tensors `read_layers` names as transformers does, and whether
# llama.cpp interleaved their q and k rows for its RoPE (the Llama family; Gemma 3's are as in the HF checkpoint).
# Others are not read: int4 is refused for them and auto serves them widened.
_INTERLEAVED_QK = {"llama": True, "gemma3": False, "gemma3_text": False}
BLOCK_ARCHITECTURES = frozenset(_INTERLEAVED_QK)


@dataclass(frozen=True, slots=True)
class GGUFLayers:
    """A GGUF file's decoder projections by HF module name (`model.layers.3.mlp.up_proj`): the 4-bit ones (Q4_0,
    Q4_1, Q4_K) as stored blocks, and the 8-bit ones (Q8_0, Q5_0, Q6_K) where asked, q and k rows in HF order;
    `wider`: the rest (Q5_K, F16 ...), which stay as loaded (dequantized to the serving dtype), never re-quantized."""

    blocks: dict[str, StoredBlocks]
    wider: frozenset[str]


def read_layers(path: str | Path, num_heads: int, num_kv_heads: int, *, model_type: str = "llama",
                int8: bool = False) -> GGUFLayers:
    """The decoder projections of the GGUF at `path`, a `model_type` of BLOCK_ARCHITECTURES (llama.cpp interleaves
    the Llama family's q and k head halves for RoPE; undone here as transformers' loader undoes it); `int8`: Q8_0,
    Q5_0 and Q6_K as Int8Blocks too (else wider). Raises ModelLoadError if it cannot be read."""
    readers: dict[GGMLQuantizationType, Callable[[np.ndarray], StoredBlocks]] = {
        **_READERS, **(_INT8_READERS if int8 else {})}
    blocks: dict[str, StoredBlocks] = {}
    wider: set[str] = set()
    for tensor in _tensors(path).values():
        if (name := _hf_name(tensor.name)) is None:
            continue
        read = readers.get(tensor.tensor_type)
        if read is None:
            wider.add(name)
            continue
        layer = read(np.asarray(tensor.data))
        if _INTERLEAVED_QK[model_type] and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
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


def read_q8_0_head(path: str | Path) -> dict[str, Int8Blocks]:
    """The output head's Q8_0 blocks (`output.weight`, else the tied `token_embd.weight`) keyed HEAD; empty when
    stored otherwise."""
    tensors = _tensors(path)
    tensor = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if tensor is None or tensor.tensor_type != GGMLQuantizationType.Q8_0:
        return {}
    return {HEAD: q8_0_blocks(np.asarray(tensor.data))}


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


def _unpermuted(blocks: StoredBlocks, num_heads: int) -> StoredBlocks:
    """Rows of each head from llama.cpp's interleaved pairs [head_dim / 2, 2] back to HF's halves [2, head_dim / 2]."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        head_dim = t.shape[0] // num_heads
        return t.reshape(num_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(t.shape)
    if isinstance(blocks, Int8Blocks):
        return Int8Blocks(rows(blocks.values), rows(blocks.scales))
    return Int4Blocks(rows(blocks.values), rows(blocks.scales), rows(blocks.minimums))
