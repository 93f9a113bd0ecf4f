"""The host side of the shared-prefix Triton kernel (triton_shared.py): whether a pass can take it, and the
pass's device tables, built once on the host and copied without blocking; every layer then is one op call.
Triton is imported here lazily, only for a device the kernel serves (a CUDA GPU; tests add the CPU under
Triton's interpreter), never at import time."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from promptcache.model_runtime.attention.split_keys import num_sms, num_splits
from promptcache.model_runtime.attention.step_indices import to_device

log = logging.getLogger(__name__)

# Where the kernel runs. fp32 stays on torch's ops: the kernel would run it at IEEE precision (its tests do),
# but the GPU's fp32 tests were measured on torch's ops and the kernel's fp32 speed never was.
KERNEL_DEVICE_TYPES = frozenset({"cuda"})
KERNEL_DTYPES = frozenset({torch.bfloat16, torch.float16})
NOT_SEEN = 1 << 30  # segment_rows entry of a sequence that is no member: above any query index
ROWS_PER_PROGRAM = 64  # triton_shared.BLOCK_ROWS, for the split-K choice (no triton import here)

_loaded: dict[str, bool] = {}

# One segment as the engine holds it: keys, values [L, H_kv, n, D], member sequences, their row offsets or None.
Segment = tuple[torch.Tensor, torch.Tensor, tuple[int, ...], "tuple[int, ...] | None"]


def triton_installed() -> bool:
    """Whether triton can be imported (not importing it)."""
    return importlib.util.find_spec("triton") is not None


def load_kernel() -> bool:
    """Import triton_shared, registering `torch.ops.promptcache.shared_prefix_attention` (once); False where
    triton is missing or fails to import (the reason is logged once)."""
    if "kernel" not in _loaded:
        try:
            importlib.import_module("promptcache.model_runtime.attention.triton_shared")
            _loaded["kernel"] = True
        except (ImportError, OSError, RuntimeError) as error:  # absent, or built for another torch/driver
            log.warning("shared-prefix Triton kernel unavailable (%s); using torch's attention ops", error)
            _loaded["kernel"] = False
    return _loaded["kernel"]


def kernel_serves(backend: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether passes on `device` in `dtype` with `backend` take the kernel (any other backend name than
    `auto` keeps torch's ops: the setting that turns the kernel off)."""
    return (backend == "auto" and device.type in KERNEL_DEVICE_TYPES and dtype in KERNEL_DTYPES
            and triton_installed() and load_kernel())


@dataclass(frozen=True, slots=True)
class PassPositions:
    """The positions the prompt plan gave a pass's tokens (int64, host): per sequence its queries' [T_i] and its own
    KV's after this pass's writes [S_i], per segment its keys' [n_j] (as attention/sliding_window.py holds them)."""

    query_positions: Sequence[torch.Tensor]
    own_positions: Sequence[torch.Tensor]
    segment_positions: Sequence[torch.Tensor]


@dataclass(frozen=True, slots=True, eq=False)
class SharedPrefixPlan:
    """One pass's kernel inputs on the device (tables: triton_shared.py). `held` keeps the segments' KV alive
    while the tables hold their addresses."""

    pool_keys: torch.Tensor    # [L, H_kv, slots, D]
    pool_values: torch.Tensor  # [L, H_kv, slots, D]
    seq_table: torch.Tensor      # int32 [B, 4]
    token_table: torch.Tensor    # int32 [Q, 2]
    segment_table: torch.Tensor  # int64 [S, 9]
    segment_rows: torch.Tensor   # int32 [S, B]
    held: tuple[torch.Tensor, ...]
    num_chunks: int
    max_query_len: int
    # Sliding windows: int32 query positions [Q], key positions [P] and where each sequence's own, then each
    # segment's, start in them [B + S] (triton_shared.py); None for a pass planned without positions.
    positions: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def attend(self, queries: torch.Tensor, layer: int, scale: float,
               window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """queries [Q, H, D] of layer `layer` -> out [Q, H, D] (their dtype), natural-log lse [Q, H] fp32.
        `window`: the layer's sliding window (a plan made with positions only)."""
        if window is None:
            return torch.ops.promptcache.shared_prefix_attention(
                queries, self.pool_keys, self.pool_values, self.seq_table, self.token_table, self.segment_table,
                self.segment_rows, layer, scale, self.num_chunks, self.max_query_len)
        assert self.positions is not None and window > 0, "a windowed layer needs a plan with positions"
        return torch.ops.promptcache.shared_prefix_attention(
            queries, self.pool_keys, self.pool_values, self.seq_table, self.token_table, self.segment_table,
            self.segment_rows, layer, scale, self.num_chunks, self.max_query_len, window, *self.positions)


def plan_shared_prefix(query_lens: Sequence[int], own_lens: Sequence[int], first_slots: Sequence[int | None],
                       pool_keys: torch.Tensor, pool_values: torch.Tensor, segments: Sequence[Segment], *,
                       num_heads: int, num_chunks: int | None = None,
                       positions: PassPositions | None = None) -> SharedPrefixPlan | None:
    """The tables of a pass: sequence i feeds query_lens[i] tokens (rows in order), its own KV (own_lens[i]
    keys, the last query_lens[i] of them its new tokens) is pool slots first_slots[i] on; `segments` as the
    engine holds them; `num_heads` query heads. None where the kernel cannot read the pass where it lies (a
    sequence outside the pool, KV of another dtype or device, a head dim not contiguous). `num_chunks`: key
    chunks per segment (None: enough programs for the device's SMs). `positions`: the pass's token positions,
    for layers with a sliding window."""
    if any(first is None for first in first_slots) or not _readable(pool_keys, pool_values, segments):
        return None
    if pool_keys.stride() != pool_values.stride():
        return None
    num_seqs, num_tokens = len(query_lens), sum(query_lens)
    num_kv_heads = pool_keys.shape[1]
    starts = list(itertools.accumulate(query_lens, initial=0))
    # [B, 4]: query start, T_b, first slot, own length (the T_b new keys included)
    seq_table = torch.tensor([[starts[i], n, first_slots[i], own_lens[i]] for i, n in enumerate(query_lens)],
                             dtype=torch.int32).reshape(num_seqs, 4)
    # [Q, 2]: each token's sequence and index within it (the shared kernel's rows are tokens x group)
    token_table = torch.tensor([[i, t] for i, n in enumerate(query_lens) for t in range(n)],
                               dtype=torch.int32).reshape(num_tokens, 2)
    kept = [s for s in segments if s[0].shape[2] > 0]  # an empty segment adds nothing
    # [S, 9]: addresses, length and (layer, head, token) strides in elements of each segment's k and v
    segment_table = torch.tensor([[k.data_ptr(), v.data_ptr(), k.shape[2], *k.stride()[:3], *v.stride()[:3]]
                                  for k, v, _, _ in kept], dtype=torch.int64).reshape(len(kept), 9)
    # [S, B]: the first query index of each member that sees the segment (a row offset), NOT_SEEN otherwise
    segment_rows = torch.full((len(kept), num_seqs), NOT_SEEN, dtype=torch.int32)
    for s, (_, _, members, offsets) in enumerate(kept):
        for j, seq in enumerate(members):
            segment_rows[s, seq] = offsets[j] if offsets else 0
    if num_chunks is None:
        longest = max((s[0].shape[2] for s in kept), default=0)
        # The shared kernel's programs: KV heads x blocks of its tokens x group rows x segments, per chunk.
        num_blocks = num_kv_heads * max(1, len(kept)) * -(-num_tokens * (num_heads // num_kv_heads) // ROWS_PER_PROGRAM)
        num_chunks = num_splits(num_blocks, longest, num_sms(pool_keys.device))
    device = pool_keys.device
    tables = None
    if positions is not None:
        kept_positions = [p for s, p in zip(segments, positions.segment_positions, strict=True) if s[0].shape[2] > 0]
        query_at, key_at, start_at = _position_tables(positions, kept_positions)
        tables = (to_device(query_at, device), to_device(key_at, device), to_device(start_at, device))
    return SharedPrefixPlan(pool_keys, pool_values, to_device(seq_table, device), to_device(token_table, device),
                            to_device(segment_table, device), to_device(segment_rows, device),
                            tuple(t for k, v, _, _ in kept for t in (k, v)), num_chunks, max(query_lens, default=0),
                            tables)


def _position_tables(positions: PassPositions, segment_positions: Sequence[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's query positions [Q], key positions [P] (own KV per sequence, then each segment's) and where each
    sequence's and segment's start in them [B + S], int32."""
    keys = [*positions.own_positions, *segment_positions]
    starts = list(itertools.accumulate((p.numel() for p in keys), initial=0))[:-1]
    queries = torch.cat([*positions.query_positions, torch.zeros(0, dtype=torch.long)])        # [Q]
    flat = torch.cat([*keys, torch.zeros(1, dtype=torch.long)])                                # [P + 1]: never empty
    return queries.to(torch.int32), flat.to(torch.int32), torch.tensor(starts, dtype=torch.int32)


def _readable(pool_keys: torch.Tensor, pool_values: torch.Tensor, segments: Sequence[Segment]) -> bool:
    """Every KV tensor on the pool's device in its dtype, [L, H_kv, n, D] with the head dim contiguous."""
    for tensor in (pool_keys, pool_values, *(t for k, v, _, _ in segments for t in (k, v))):
        if (tensor.device != pool_keys.device or tensor.dtype != pool_keys.dtype or tensor.dim() != 4
                or tensor.shape[1] != pool_keys.shape[1] or tensor.shape[3] != pool_keys.shape[3]
                or tensor.stride(3) != 1):
            return False
    return True
