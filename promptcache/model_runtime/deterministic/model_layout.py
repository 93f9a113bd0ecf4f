"""Whether a model can be served deterministically here (`problem`) and laying it out for that at load (`apply`)."""

from __future__ import annotations

from typing import Any

import torch

from promptcache.model_runtime.deterministic import kernels
from promptcache.model_runtime.deterministic.layers import SUPPORTED_DTYPES, RotaryTable, ops, replace_linears
from promptcache.model_runtime.loading import fused_layers

ARCHITECTURES = ("llama", "mistral", "qwen2")
# RoPE whose angles depend on the sequence's length: a position's cos/sin is no fixed table entry.
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


def problem_of_settings(device: str, dtype: str, weights: str) -> str | None:
    """What the settings alone rule out (checked where a ModelConfig is made), or None."""
    if device != "cpu":
        return f"it runs on the CPU only, not on {device!r} (there are no batch-invariant CUDA kernels)"
    if weights != "native":
        return f"it needs native weights, not {weights} (the batch-invariant kernels have no quantized products)"
    if dtype not in ("auto", *(str(t).removeprefix("torch.") for t in SUPPORTED_DTYPES)):
        return f"it runs in float32 or bfloat16, not {dtype}"
    return None


def problem(config: Any, dtype: torch.dtype, device: str, weights: str) -> str | None:
    """Why deterministic serving cannot run this model here (one sentence naming the combination), or None."""
    if (found := problem_of_settings(device, str(dtype).removeprefix("torch."), weights)) is not None:
        return found
    if config.model_type not in ARCHITECTURES:
        return f"it serves {', '.join(ARCHITECTURES)} models, not {config.model_type!r}"
    if config.hidden_act != "silu" or getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return "it needs SiLU gating and RoPE over whole heads"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in _LENGTH_DEPENDENT_ROPE:
        return f"its RoPE ({rope.get('rope_type', rope.get('type'))}) rescales with the sequence length"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim % 8:
        return f"it needs a head dimension that is a multiple of 8, not {head_dim}"
    if kernels.prepare() is None:
        return f"its kernels are not available: {kernels.unavailable_reason()}"
    return None


def apply(model: Any) -> None:
    """Lay `model` out in place (after `problem` said None): fused layers on the batch-invariant ops, every linear
    layer a DeterministicLinear, RoPE from a table."""
    fused = fused_layers.fuse_layers(model, ops())
    assert fused, "problem() admits only architectures fuse_layers fuses"
    replace_linears(model)
    model.base_model.rotary_emb = RotaryTable(model.base_model.rotary_emb)
