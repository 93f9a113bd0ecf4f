"""The shared KV segment type."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, eq=False)
class SharedSegment:
    """KV attended in full by the queries of the sequences in `seq_indices` (referenced, not copied).

    `row_offsets[j]` (default all 0) skips the first queries of sequence `seq_indices[j]`: they are
    positioned before this KV and must not see it (a prefill that recomputes tokens among cached ones).
    """

    keys: torch.Tensor     # [num_kv_heads, seg_len, head_dim]
    values: torch.Tensor   # [num_kv_heads, seg_len, head_dim]
    seq_indices: tuple[int, ...]
    row_offsets: tuple[int, ...] | None = None
