"""StepBuffers: the static device inputs of a graph-captured step (ids, positions, KV write slots, attention tables,
last-token rows) as views of ONE int64 device tensor, filled from ONE pinned host tensor by ONE copy per step."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from promptcache.model_runtime.attention.shared_prefix import NOT_SEEN

DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)  # sequences of an all-decode step
PREFILL_BUCKETS = (16, 32, 64, 128, 256)            # new tokens of a lone prefill
SEGMENT_BUCKETS = (0, 1, 2, 4, 8, 16)               # shared segments (more: the step runs eagerly)
TRASH_SLOTS = PREFILL_BUCKETS[-1]  # a padded row writes (and reads) only these pool slots, each its own


def bucket(size: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= size, or None when none is."""
    i = bisect.bisect_left(buckets, size)
    return buckets[i] if i < len(buckets) else None


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a captured graph is specialized to: rows fed, sequences (pads included), segments, key chunks."""

    num_rows: int
    num_seqs: int
    num_segments: int
    num_chunks: int
    max_query_len: int


@dataclass(frozen=True, slots=True)
class SeqInput:
    """One real sequence of a uniform step: its new tokens, their positions, its pool range and its own length
    after the step (the new tokens included)."""

    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    first_slot: int
    own_length: int


@dataclass(frozen=True, slots=True)
class SegmentInput:
    """One shared segment: its KV [L, H_kv, n, D] and the first new-token index of each sequence that sees it."""

    keys: torch.Tensor
    values: torch.Tensor
    first_rows: dict[int, int]  # sequence index -> first query index t that sees it


# int64 fields then int32 fields of the flat buffer, in order; sizes by StepShape
_I64 = ("input_ids", "positions", "write_slots", "last_rows", "segment_table")
_I32 = ("seq_table", "token_table", "segment_rows")


def _sizes(shape: StepShape) -> dict[str, tuple[int, ...]]:
    r, b, s = shape.num_rows, shape.num_seqs, shape.num_segments
    return {"input_ids": (r,), "positions": (r,), "write_slots": (r,), "last_rows": (b,), "segment_table": (s, 9),
            "seq_table": (b, 4), "token_table": (r, 2), "segment_rows": (s, b)}


class StepBuffers:
    """The static inputs of one StepShape on `device` and their pinned host twin. `fill` rewrites every entry (pads
    included) on the host and copies the whole buffer in one H2D copy; the device views never move, so a captured
    graph reads each step's values. Never cached across steps: tables are rebuilt every fill."""

    def __init__(self, shape: StepShape, device: torch.device) -> None:
        self.shape, self.device = shape, device
        sizes = _sizes(shape)
        num_i64 = sum(int(np.prod(sizes[n])) for n in _I64)
        num_i32 = sum(int(np.prod(sizes[n])) for n in _I32)
        total = num_i64 + (num_i32 + 1) // 2
        pinned = device.type == "cuda"
        self._host = torch.zeros(total, dtype=torch.int64, pin_memory=pinned)     # [total]
        self._device = torch.zeros(total, dtype=torch.int64, device=device)       # [total]
        self._copied: torch.cuda.Event | None = None
        self.host = _views(self._host, sizes)
        self.views = _views(self._device, sizes)
        self._np = {name: view.numpy() for name, view in self.host.items()}

    def fill(self, seqs: list[SeqInput], segments: list[SegmentInput], trash_slot: int) -> None:
        """Write a step's inputs: `seqs` are the real sequences (decode: T = 1 each; prefill: one), padded with
        sequences of trash slots only; `segments` padded with empty ones no row sees. Then one H2D copy."""
        shape = self.shape
        assert len(seqs) <= shape.num_seqs and len(segments) <= shape.num_segments
        if self._copied is not None:  # the previous step's copy has left the host buffer
            self._copied.synchronize()
        arrays = self._np
        ids, positions, slots = arrays["input_ids"], arrays["positions"], arrays["write_slots"]
        seq_table, token_table, last_rows = arrays["seq_table"], arrays["token_table"], arrays["last_rows"]
        # Rows are the real sequences' tokens in order, then pad rows. Pad sequence j (after the real ones) takes
        # the pad rows that are its own: one each in decode, all the rest in a prefill; its row t writes trash
        # slot trash_slot + (its first pad row) + t and sees only its own trash keys, so no pad row ever writes a
        # live sequence's KV and every row sees at least one key (no 0/0).
        row = 0
        for b, seq in enumerate(seqs):
            n = len(seq.token_ids)
            ids[row: row + n] = seq.token_ids
            positions[row: row + n] = seq.positions
            start = seq.first_slot + seq.own_length - n  # new token t's KV goes to own slot own_length - n + t
            slots[row: row + n] = np.arange(start, start + n)
            seq_table[b] = (row, n, seq.first_slot, seq.own_length)
            token_table[row: row + n, 0] = b
            token_table[row: row + n, 1] = np.arange(n)
            last_rows[b] = row + n - 1
            row += n
        num_real_rows, num_pad_seqs = row, shape.num_seqs - len(seqs)
        for j in range(num_pad_seqs):
            b = len(seqs) + j
            n = shape.num_rows - row if j == num_pad_seqs - 1 else 1  # decode: 1 each; prefill: all the rest (or 0)
            first = trash_slot + row - num_real_rows
            ids[row: row + n] = 0
            positions[row: row + n] = np.arange(n)
            slots[row: row + n] = np.arange(first, first + n)
            seq_table[b] = (row, n, first, n)
            token_table[row: row + n, 0] = b
            token_table[row: row + n, 1] = np.arange(n)
            last_rows[b] = max(row + n - 1, 0)
            row += n
        assert row == shape.num_rows, (row, shape)
        self._fill_segments(segments, trash_slot)
        if self.device.type == "cuda":
            self._device.copy_(self._host, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._device.copy_(self._host)

    def _fill_segments(self, segments: list[SegmentInput], trash_slot: int) -> None:
        table, rows = self._np["segment_table"], self._np["segment_rows"]
        rows[:] = NOT_SEEN
        table[:] = 0
        for s, segment in enumerate(segments):
            k, v = segment.keys, segment.values
            table[s] = (_address(k), _address(v), k.shape[2], *k.stride()[:3], *v.stride()[:3])
            for b, first_row in segment.first_rows.items():
                rows[s, b] = first_row
        # A pad segment is empty (length 0) and seen by no row: the kernel reads none of it.


def _address(tensor: torch.Tensor) -> int:
    """The address the kernel reads `tensor` at (0 on the meta device, which has no storage to point at)."""
    return 0 if tensor.device.type == "meta" else tensor.data_ptr()


def _views(flat: torch.Tensor, sizes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Named views of `flat` (int64): the _I64 fields, then the _I32 fields packed two to an entry."""
    views, offset = {}, 0
    for name in _I64:
        count = int(np.prod(sizes[name]))
        views[name] = flat[offset: offset + count].view(sizes[name])
        offset += count
    packed = flat[offset:].view(torch.int32)
    offset = 0
    for name in _I32:
        count = int(np.prod(sizes[name]))
        views[name] = packed[offset: offset + count].view(sizes[name])
        offset += count
    return views
