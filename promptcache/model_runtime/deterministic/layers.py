"""A model laid out at load for deterministic serving: decoder layers fused (q|k|v, gate|up) with the batch-invariant
RMSNorm and SiLU gate, every linear layer a `DeterministicLinear`, and RoPE's cos/sin read from a table by position.
Nothing in the stack then computes a row's result from other rows or splits a row's sums by the step's shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from promptcache.model_runtime.deterministic import kernels
from promptcache.model_runtime.loading import torch_layer_ops

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
_TABLE_CHUNK = 4096  # positions whose cos/sin one call computes, the first time a position in it is used


class DeterministicLinear(torch.nn.Module):
    """`y = x W^T + b` through the batch-invariant kernel: each output element one fp32 FMA chain over the input
    features in order, however many rows x has. W lives only in the kernel's packed layout (inference only)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        module = kernels.prepare()
        assert module is not None, "deterministic layers are built only where the kernels loaded"
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = module.pack(linear.weight.detach().contiguous())  # [ceil(out / 16), in, 16]
        self.bias = None if linear.bias is None else linear.bias.detach().to(linear.weight.dtype).contiguous()
        self._linear = module.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in] -> [..., out]
        rows = x.reshape(-1, self.in_features)
        return self._linear(rows if rows.stride(-1) == 1 else rows.contiguous(), self.packed_weight,
                            self.out_features, self.bias).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@dataclass(frozen=True, slots=True)
class DeterministicOps:
    """`fused_layers.LayerOps` for deterministic serving: the kernels' RMSNorm and SiLU gate; RoPE as torch's
    element-wise multiplies and adds (each one IEEE rounding per element, the same in any lane or thread)."""

    rms_norm: Any
    silu_mul: Any
    rope_qk: Any = torch_layer_ops.rope_qk


class RotaryTable(torch.nn.Module):
    """A model's rotary embedding as a table: cos/sin of a position are computed once (by the model's own module, a
    chunk of positions per call) and read back by index, so a position's values never depend on the step's others."""

    def __init__(self, rotary: torch.nn.Module) -> None:
        super().__init__()
        self.rotary = rotary
        self.cos: torch.Tensor | None = None  # [chunks * _TABLE_CHUNK, D] float32
        self.sin: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids [B, T] -> cos, sin [B, T, D] in x's dtype, as the Hugging Face rotary module returns them
        last = int(position_ids.max()) if position_ids.numel() else 0
        while self.cos is None or self.sin is None or self.cos.shape[0] <= last:
            first = 0 if self.cos is None else self.cos.shape[0]
            positions = torch.arange(first, first + _TABLE_CHUNK, device=x.device)[None]  # [1, chunk]
            probe = torch.empty(1, dtype=torch.float32, device=x.device)
            cos, sin = self.rotary(probe, positions)  # [1, chunk, D] float32
            self.cos = cos[0] if self.cos is None else torch.cat([self.cos, cos[0]])
            self.sin = sin[0] if self.sin is None else torch.cat([self.sin, sin[0]])
        return self.cos[position_ids].to(x.dtype), self.sin[position_ids].to(x.dtype)


def ops() -> DeterministicOps:
    """The element-wise ops of deterministic layers (the kernels must have loaded)."""
    module = kernels.prepare()
    assert module is not None, "deterministic layers are built only where the kernels loaded"
    return DeterministicOps(module.rms_norm, module.silu_mul)


def replace_linears(model: torch.nn.Module) -> int:
    """Every `nn.Linear` of `model` (the LM head included; a tied weight is copied) as a DeterministicLinear, in place;
    returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, DeterministicLinear(child))
                replaced += 1
    return replaced
