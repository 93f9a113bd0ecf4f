"""KeyShifter: moves cached keys that carry rotary position embeddings (RoPE) to other positions. Rotations in
one plane compose, so rotating a key stored at p by `shift`'s angle gives RoPE's key at p + shift (up to rounding):
fidelity modes re-align reused module KV to contiguous positions for one request (reuse_plan.py). Gemma 3 rotates its
local and global layers with different bases: its shifter holds one row of frequencies per layer."""

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
    """Shifts keys [..., n, head_dim] in HF's rotate-half layout by a per-token number of positions; keys of every
    layer [L, ..., n, head_dim] when the frequencies differ by layer (`inv_freq` [L, R/2])."""

    def __init__(self, inv_freq: torch.Tensor, head_dim: int) -> None:
        if 2 * inv_freq.shape[-1] > head_dim:
            raise ValueError(f"{inv_freq.shape[-1]} RoPE frequencies do not fit a head of {head_dim} dimensions")
        if inv_freq.dim() not in (1, 2):
            raise ValueError(f"inv_freq must be [R/2] or [num_layers, R/2], got shape {tuple(inv_freq.shape)}")
        self.inv_freq = inv_freq.detach().float().cpu()  # [R/2] or [L, R/2], R = rotated dimensions
        self.head_dim = head_dim
        # Per layer: its row among the distinct ones (Gemma 3: two), so each row's cos/sin is computed once a shift.
        self._rows, self._row_of_layer = self.inv_freq[None], torch.zeros(1, dtype=torch.long)  # [U, R/2], [L]
        if inv_freq.dim() == 2:
            self._rows, self._row_of_layer = self.inv_freq.unique(dim=0, return_inverse=True)

    @property
    def is_per_layer(self) -> bool:
        """Whether the frequencies differ by layer: keys then come with all layers, the layer first."""
        return self.inv_freq.dim() == 2

    @classmethod
    def of(cls, model: PreTrainedModel, head_dim: int) -> KeyShifter | None:
        """The shifter of an HF decoder whose rotary embedding is static, else None (learned or rescaling). Gemma 3's
        rotary embedding keeps one table per layer type (`{type}_inv_freq`, `rope_type` a dict by type): each layer
        gets its type's."""
        rotary = getattr(model.base_model, "rotary_emb", None)
        if rotary is None:
            return None
        rope_type = getattr(rotary, "rope_type", "default")
        if isinstance(rope_type, dict):
            return cls._per_layer_type(rotary, rope_type, model.config.layer_types, head_dim)
        if rope_type not in _STATIC_ROPE_TYPES:
            return None
        inv_freq = getattr(rotary, "inv_freq", None)
        return cls(inv_freq, head_dim) if isinstance(inv_freq, torch.Tensor) else None

    @classmethod
    def _per_layer_type(cls, rotary: torch.nn.Module, rope_types: dict[str, str], layer_types: list[str],
                        head_dim: int) -> KeyShifter | None:
        if any(rope_types.get(kind) not in _STATIC_ROPE_TYPES for kind in layer_types):
            return None
        rows = [row for kind in layer_types if isinstance(row := getattr(rotary, f"{kind}_inv_freq", None),
                                                           torch.Tensor)]
        return cls(torch.stack(rows), head_dim) if len(rows) == len(layer_types) else None  # [L, R/2]

    def shift_into(self, out: torch.Tensor, keys: torch.Tensor, shift: torch.Tensor) -> None:
        """Write `keys` [..., n, D] moved by `shift` [n] positions (long) into `out` (same shape; may
        be a view of a larger buffer, must not alias `keys`); per-layer frequencies: `keys` [L, ..., n, D]. The angles
        are computed in float32."""
        if not self.is_per_layer:
            self._rotate_into(out, keys, *self._cos_sin(0, shift, keys.dtype))
            return
        if keys.shape[0] != self.inv_freq.shape[0]:
            raise ValueError(f"keys of {keys.shape[0]} layers for RoPE frequencies of {self.inv_freq.shape[0]}")
        tables = [self._cos_sin(row, shift, keys.dtype) for row in range(self._rows.shape[0])]
        for layer, row in enumerate(self._row_of_layer.tolist()):
            self._rotate_into(out[layer], keys[layer], *tables[row])

    def _cos_sin(self, row: int, shift: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [n, R/2] of the angles `shift` moves by under the frequencies of row `row`."""
        angle = shift.to(torch.float32)[:, None] * self._rows[row].to(shift.device)[None, :]  # [n, R/2]
        return angle.cos().to(dtype), angle.sin().to(dtype)

    def _rotate_into(self, out: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        half = cos.shape[-1]
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
