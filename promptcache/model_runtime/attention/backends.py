"""CPU attention kernels returning (out, lse): plain matmul (also the reference on any device), the fused CPU op and
our bf16 kernel (GPU: gpu_backends.py). q [G_kv, M, D] (query rows folded per KV head), k/v [G_kv, N, D] with N > 0,
an optional bool mask [M, N] (True = attend); out [G_kv, M, D], lse [G_kv, M] fp32."""

from __future__ import annotations

import torch

from promptcache.model_runtime.attention import bf16_kernel


def matmul_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Always-correct reference kernel, any dtype (scores in fp32)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [G_kv, M, N]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                  # [G_kv, M]
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)          # fully masked rows -> 0
    return torch.matmul(probs, v.float()), lse


def fused_cpu_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's fused CPU flash attention; masked or empty-KV calls (lse = 0 for masked rows, a crash) take matmul."""
    if mask is not None or k.shape[1] == 0:
        return matmul_attend(q, k, v, scale, mask)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0, False, scale=scale)  # [1, G_kv, M, D], [1, G_kv, M]
    return out[0], lse[0]


def bf16_cpu_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The AVX512-BF16 kernel (bf16_kernel.py) where it can run this call, torch's fused op otherwise."""
    kernel = None if mask is not None else bf16_kernel.eligible(q, k, v)
    if kernel is None:
        return fused_cpu_attend(q, k, v, scale, mask)
    out, lse = kernel(q, [k], [v], scale, False)  # [G_kv, M, D], [G_kv, M]
    return out, lse
