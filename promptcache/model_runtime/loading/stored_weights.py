"""Which weight format a model is served in and the checkpoint blocks that go with it: `auto` (the server's default)
serves a GGUF whose decoder layers are stored in 4 bits as stored where an int4 product with vector code runs
(`quantized_linear.int4_is_fast`; int4: the kernel reads them at a quarter of bf16's bytes, and nothing is rounded
that the file did not round), in fp32 a native GGUF's Q8_0 head from its blocks, anything else as loaded."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from promptcache.model_runtime.errors import ModelLoadError
from promptcache.model_runtime.loading import quantized_linear
from promptcache.model_runtime.loading.quantized_linear import Int4Blocks, WeightFormat

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StoredWeights:
    """The format a model loads in (never auto); for int4 from a GGUF its 4-bit blocks by HF module name (with its
    8-bit head under HEAD) and `wider`, the layers it stores in more bits (kept float: never rounded to 4 bits);
    `reason`: why this format (the startup log says it)."""

    weights: WeightFormat
    reason: str
    blocks: Mapping[str, Int4Blocks] = field(default_factory=dict)
    wider: frozenset[str] = frozenset()


def choose(requested: WeightFormat, gguf: Path | None, num_heads: int, num_kv_heads: int, *, device: str,
           dtype: torch.dtype, deterministic: bool, model_type: str = "llama") -> StoredWeights:
    """Resolve `requested` for a checkpoint (`gguf`: the file it was loaded from, None for other formats; `model_type`:
    what transformers loaded it as) served on `device` in `dtype`, and read the file's blocks if it is served int4.
    Called once per load, before the model is wrapped; reads the file's header (auto) and its 4-bit tensors (int4).
    Raises ModelLoadError if the file is unreadable, or int4 is asked for a GGUF whose tensors gguf_weights does not
    map (BLOCK_ARCHITECTURES)."""
    from promptcache.model_runtime.loading import gguf_weights

    weights, reason = requested, "asked for"
    if requested is WeightFormat.AUTO:
        weights, reason = _auto(gguf, model_type, device, dtype, deterministic)
        logger.info("weights auto: %s (%s)", weights.value, reason)
    if weights is not WeightFormat.INT4 or gguf is None:
        if requested is WeightFormat.AUTO and _head_as_stored(gguf, device, dtype, deterministic):
            assert gguf is not None
            head = gguf_weights.read_q8_0_head(gguf)
            if head:  # the very weights the widened head holds, at a quarter of its bytes
                return StoredWeights(weights, f"{reason}; the output head multiplies the file's Q8_0 blocks", head)
        return StoredWeights(weights, reason)
    if model_type not in gguf_weights.BLOCK_ARCHITECTURES:
        readable = ", ".join(sorted(gguf_weights.BLOCK_ARCHITECTURES))
        raise ModelLoadError(f"int4 weights read the 4-bit blocks of {readable} GGUF files, not of {gguf.name} "
                             f"({model_type}); serve it with --weights native (or auto)")
    layers = gguf_weights.read_layers(gguf, num_heads, num_kv_heads)
    return StoredWeights(weights, reason, {**layers.blocks, **gguf_weights.read_q8_0_head(gguf)}, layers.wider)


def _head_as_stored(gguf: Path | None, device: str, dtype: torch.dtype, deterministic: bool) -> bool:
    """Whether auto serves a native GGUF's Q8_0 output head from its blocks: in fp32 on a CPU with the AVX2 Q8_0 product
    (an fp16 scale times an int8 is exact in fp32, so the weights are the widened head's)."""
    from promptcache.model_runtime import avx2

    return (gguf is not None and device == "cpu" and dtype == torch.float32 and not deterministic
            and avx2.int8_ops() is not None)


def _auto(gguf: Path | None, model_type: str, device: str, dtype: torch.dtype,
          deterministic: bool) -> tuple[WeightFormat, str]:
    """int4 for a GGUF stored in 4 bits that this machine's int4 kernel serves, else native; and why."""
    from promptcache.model_runtime.loading.gguf_weights import BLOCK_ARCHITECTURES, is_4bit

    if gguf is None:
        return WeightFormat.NATIVE, "not a GGUF checkpoint"
    if model_type not in BLOCK_ARCHITECTURES:
        return WeightFormat.NATIVE, f"int4 reads the blocks of {', '.join(sorted(BLOCK_ARCHITECTURES))} GGUF files, " \
                                    f"not {model_type}'s"
    if not is_4bit(gguf):
        return WeightFormat.NATIVE, "the GGUF stores most decoder weights in more than 4 bits"
    if device != "cpu":
        return WeightFormat.NATIVE, f"the int4 kernel runs on the CPU, not on {device}"
    if deterministic:
        return WeightFormat.NATIVE, "the batch-invariant kernels have no quantized products"
    if (problem := quantized_linear.kernel_problem(WeightFormat.INT4, dtype)) is not None:
        return WeightFormat.NATIVE, f"the int4 kernel cannot run here: {problem}"
    if not quantized_linear.int4_is_fast(dtype):
        return WeightFormat.NATIVE, "no int4 product with vector code here (PyTorch's needs AVX-512; ours, " \
                                    "`promptcache build-kernels`, AVX2 for fp32 or AVX512-BF16): slower than the " \
                                    "widened weights"
    return WeightFormat.INT4, "the GGUF stores its decoder weights in 4 bits: served as stored"
