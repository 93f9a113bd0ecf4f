"""The fused decoder layers' element-wise ops as PyTorch ops for GPUs (a step is bound by kernel launches): the HF
modules' arithmetic in the same dtypes and order, in fewer launches. `bf16_kernel.FusedOps` (CPU) has the same three."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, H] -> `weight * round(x * rsqrt(mean(x^2) + eps))`, the statistic in fp32 (LlamaRMSNorm's order)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate|up [N, 2I] -> silu(gate) * up [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
            num_kv_heads: int) -> list[torch.Tensor]:
    """qkv [N, (H + 2 H_kv) D], cos/sin [N, D] -> [q [N, H, D], k [N, H_kv, D]] rotated as
    `apply_rotary_pos_emb` rotates them (`x * cos + rotate_half(x) * sin`), q and k in one pass each op."""
    rows, dim = qkv.shape[0], cos.shape[-1]
    qk = qkv[:, : (num_heads + num_kv_heads) * dim].view(rows, num_heads + num_kv_heads, dim)
    half = dim // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)           # rotate_half
    out = qk * cos[:, None] + rotated * sin[:, None]                           # [N, H + H_kv, D]
    return [out[:, :num_heads], out[:, num_heads:]]
