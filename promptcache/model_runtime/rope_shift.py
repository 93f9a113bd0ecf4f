"""KeyShifter: moves cached keys that carry rotary position embeddings (RoPE) to other positions. Rotations in
one plane compose, so rotating a key stored at p by `shift`'s angle gives RoPE's key at p + shift (up to rounding):
fidelity modes re-align reused module KV to contiguous positions for one request (reuse_plan.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from promptcache.model_runtime.attention import bf16_kernel

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# RoPE variants whose frequencies do not depend on the sequence length (a key's rotation is a
# function of its position alone). "dynamic" and "longrope" rescale with the length: no fixed shift.
_STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


class KeyShifter:
    """Shifts keys [..., n, head_dim] in HF's rotate-half layout by a per-token number of positions."""

    def __init__(self, inv_freq: torch.Tensor, head_dim: int) -> None:
        if 2 * inv_freq.numel() > head_dim:
            raise ValueError(f"{inv_freq.numel()} RoPE frequencies do not fit a head of {head_dim} dimensions")
        self.inv_freq = inv_freq.detach().float().cpu()  # [R/2], R = rotated dimensions
        self.head_dim = head_dim

    @classmethod
    def of(cls, model: PreTrainedModel, head_dim: int) -> KeyShifter | None:
        """The shifter of an HF decoder whose rotary embedding is static, else None (learned or rescaling)."""
        rotary = getattr(model.base_model, "rotary_emb", None)
        if rotary is None or getattr(rotary, "rope_type", "default") not in _STATIC_ROPE_TYPES:
            return None
        inv_freq = getattr(rotary, "inv_freq", None)
        return cls(inv_freq, head_dim) if isinstance(inv_freq, torch.Tensor) else None

    def shift_into(self, out: torch.Tensor, keys: torch.Tensor, shift: torch.Tensor) -> None:
        """Write `keys` [..., n, D] moved by `shift` [n] positions (long) into `out` (same shape; may
        be a view of a larger buffer, must not alias `keys`). The angles are computed in float32."""
        half = self.inv_freq.numel()
        angle = shift.to(torch.float32)[:, None] * self.inv_freq.to(shift.device)[None, :]  # [n, R/2]
        cos, sin = angle.cos().to(keys.dtype), angle.sin().to(keys.dtype)                   # [n, R/2]
        ops = bf16_kernel.fused_ops()
        if ops is not None and keys.dtype == out.dtype == torch.bfloat16 and not keys.is_cuda and half % 16 == 0:
            rows_in, rows_out = _rows(keys), _rows(out)
            if rows_in is not None and rows_out is not None:  # one pass, the same roundings as below
                ops.shift_keys(rows_out, rows_in, cos, sin)
                return
        first, second = keys[..., :half], keys[..., half: 2 * half]                       # [..., n, R/2]
        # RoPE's rotate-half pairs dimension i with i + R/2: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
        # One pass over whole rows, then two over halves: ~20 % faster than four half passes here.
        torch.mul(keys[..., : 2 * half], torch.cat((cos, cos), dim=-1), out=out[..., : 2 * half])
        out[..., :half].addcmul_(second, sin, value=-1)
        out[..., half: 2 * half].addcmul_(first, sin)
        if 2 * half < keys.shape[-1]:  # partial rotary: the other dimensions carry no position
            out[..., 2 * half:].copy_(keys[..., 2 * half:])

    def shifted(self, keys: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """`keys` [..., n, D] moved by `shift` [n] positions, as a new tensor."""
        out = torch.empty_like(keys)
        self.shift_into(out, keys, shift)
        return out


def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """[..., n, D] as a [B, n, D] view with a contiguous last dim, or None when the leading dims do not merge."""
    if t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, *t.shape[-2:])
    except RuntimeError:
        return None
