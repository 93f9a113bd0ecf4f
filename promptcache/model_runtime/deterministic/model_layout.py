"""Whether a model can be served deterministically here (`problem`) and laying it out for that at load (`apply`)."""

from __future__ import annotations

from typing import Any

import torch

from promptcache.model_runtime.deterministic import kernels
from promptcache.model_runtime.deterministic.layers import SUPPORTED_DTYPES, RotaryTable, ops, replace_linears
from promptcache.model_runtime.loading import architectures, fused_layers

# The architectures whose decoder layers fuse (architectures.py): their fused modules run on the kernels' ops (Qwen3's
# per-head q/k RMSNorm too: a row of D each). A position's cos/sin must be a fixed table entry: RoPE that rescales
# with the length (LENGTH_DEPENDENT_ROPE) is refused below, as the loader refuses it for every mode.
ARCHITECTURES = tuple(a.model_type for a in architectures.ARCHITECTURES.values() if a.fusable)


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
    if config.hidden_act != "silu" or architectures.rotary_fraction(config) != 1.0:
        return "it needs SiLU gating and RoPE over whole heads"
    if (rope_type := architectures.length_dependent_rope(config)) is not None:
        return f"its RoPE ({rope_type}) rescales with the sequence length"
    head_dim = architectures.head_dim_of(config)
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
