"""The shared KV segment type."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, eq=False)
class SharedSegment:
    """KV attended in full by every query of the sequences in `seq_indices` (referenced, not copied)."""

    keys: torch.Tensor     # [num_kv_heads, seg_len, head_dim]
    values: torch.Tensor   # [num_kv_heads, seg_len, head_dim]
    seq_indices: tuple[int, ...]
