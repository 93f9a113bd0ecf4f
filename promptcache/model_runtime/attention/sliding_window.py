"""Sliding-window attention over positioned KV: on a layer with window W a query at position q reads a key at position
k only if the key is visible today (a segment from its row offset on, own KV causally) and q - k < W, the positions
being those the prompt plan gave the tokens (module KV lies at fixed, possibly discontinuous positions). A pass whose
window cuts nothing takes the ordinary paths; otherwise each sequence gathers only the keys some query of it can
still reach (KV wholly out of reach is never read) and attends them under one bool mask, or, in bf16 where the keys lie
at consecutive positions (a prefill of new text, a question after the text it continues), through the bf16 kernel's
causal band (`window`), which skips the keys out of a block's reach instead of masking them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from promptcache.model_runtime.attention import bf16_kernel

# A shared segment as BatchContext holds it: keys and values [L, H_kv, n, D], member sequences, their row offsets.
Segment = tuple[torch.Tensor, torch.Tensor, tuple[int, ...], tuple[int, ...] | None]
# Own keys and values so far of every sequence at one layer: per sequence [H_kv, S_i, D].
OwnKV = Callable[[int], tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]]
# Rows of a long pass attended per SDPA call on a local layer: each block computes rows x (block + W) scores for
# rows x W it keeps. Gemma 3 270M's local layer over 2.2K rows (W 512, bf16, 2 threads, an AVX512-BF16 EPYC):
# 256 rows 39.7 ms, 128 34.2, 64 32.5-34.0, 32 39.4 (smaller blocks pay per call).
QUERY_BLOCK = 128


@dataclass(frozen=True, slots=True)
class _Gather:
    """What one sequence reads on layers of one window: per part (segment number, or -1 for its own KV) the kept key
    indices (None: all of them; a slice: one run of them, read as a view), and which query row sees which gathered
    key."""

    rows: slice
    parts: tuple[tuple[int, torch.Tensor | slice | None], ...]
    mask: torch.Tensor  # [T_i, m] bool, True = attend; m: the gathered keys, parts in order
    # The gathered keys lie at consecutive positions ending at the last query's, the queries at consecutive ones, no
    # segment hidden from a row: the mask is then the causal band of the window over the keys' order (a prefill of
    # new text, or new text after text it continues), which the bf16 kernel applies itself (`window`).
    band: bool = False


@dataclass(frozen=True, slots=True)
class DecodeParts:
    """A `DecodeBatch`'s arguments (attention/decode_batch.py), in its order: own keys, values, lengths; segment keys,
    values, member sequences."""

    own_keys: list[torch.Tensor]
    own_values: list[torch.Tensor]
    own_lens: list[int]
    segment_keys: list[torch.Tensor]
    segment_values: list[torch.Tensor]
    segment_members: list[list[int]]


@dataclass(eq=False)
class WindowedPass:
    """The positions one forward pass attends, for its sliding-window layers (built on the host by the runner).

    `windows[l]`: layer l's window (None: full attention). `query_positions[i]` [T_i] and `own_positions[i]` [S_i]
    (int64, host): sequence i's queries this pass and its own KV after this pass's writes (the last T_i being the
    queries' own tokens); `segment_positions[j]` [n_j]: the positions of `segments[j]`'s keys. `per_row`: every query
    row attends exactly the keys in its own window, one call each, whatever else the pass holds (deterministic
    serving: the same keys in the same order however a prompt is chunked or batched)."""

    windows: tuple[int | None, ...]
    query_positions: list[torch.Tensor]
    own_positions: list[torch.Tensor]
    segments: Sequence[Segment]
    segment_positions: Sequence[torch.Tensor]
    per_row: bool = False
    _spans: list[int] = field(init=False, repr=False)
    _gathers: dict[tuple[int, str], list[_Gather]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # Per sequence: its last query's position minus the smallest position of a key it sees (the window cuts
        # nothing of it while this is < W).
        lowest = [int(p.min()) for p in self.own_positions]
        for (_, _, members, offsets), positions in zip(self.segments, self.segment_positions):
            for index, seq in enumerate(members):
                offset = offsets[index] if offsets else 0
                if positions.numel() and offset < self.query_positions[seq].numel():
                    lowest[seq] = min(lowest[seq], int(positions.min()))
        self._spans = [int(q.max()) - low for q, low in zip(self.query_positions, lowest)]

    def cuts(self, layer: int) -> bool:
        """Whether `layer` slides and its window hides some visible key from some query of this pass."""
        window = self.windows[layer] if layer < len(self.windows) else None
        return window is not None and (self.per_row or any(span >= window for span in self._spans))

    def cuts_any(self) -> bool:
        """Whether some layer's window cuts in this pass (fast paths that ignore windows stay off then)."""
        return any(self.cuts(layer) for layer in range(len(self.windows)))

    def attend(self, queries: torch.Tensor, layer: int, own_kv: OwnKV, scale: float) -> torch.Tensor:
        """queries [total_q, H, D] (sequences in row order) at window layer `layer`; returns [total_q, H, D]."""
        window = self.windows[layer]
        assert window is not None, "a layer without a window takes the ordinary paths"
        own_keys, own_values = own_kv(layer)
        out = torch.empty_like(queries)
        for seq, gather in enumerate(self._gathers_of(window, queries.device)):
            key_parts = self._parts(gather, layer, own_keys[seq], 0)                  # views [H_kv, n_j, D]
            value_parts = self._parts(gather, layer, own_values[seq], 1)
            q = queries[gather.rows]                                                   # [T_i, H, D]
            kernel = bf16_kernel.eligible(q, key_parts[0], value_parts[0]) if gather.band else None
            if kernel is not None and not self.per_row:  # [T_i, H, D] -> [H, T_i, D] views, the band in the kernel
                out[gather.rows] = kernel(q.transpose(0, 1), key_parts, value_parts, scale, True, [],
                                          window)[0].transpose(0, 1)
                continue
            keys, values = torch.cat(key_parts, dim=1), torch.cat(value_parts, dim=1)  # [H_kv, m, D]
            if self.per_row:
                for row in range(q.shape[0]):
                    seen = gather.mask[row].nonzero()[:, 0]
                    out[gather.rows.start + row] = _sdpa(q[row: row + 1], keys[:, seen], values[:, seen], None,
                                                         scale)[0]
            else:
                out[gather.rows] = _blockwise_sdpa(q, keys, values, gather.mask, scale)
        return out

    def decode_parts(self, window: int, own_keys: Sequence[torch.Tensor], own_values: Sequence[torch.Tensor],
                     own_lens: Sequence[int]) -> DecodeParts | None:
        """For a pass where every sequence decodes one token: what its query reaches on layers of `window` (keys at
        positions > q - W), as the decode kernel's `DecodeBatch` takes it (own KV [L, H_kv, capacity, D] holding
        own_lens keys): views, nothing copied. Own KV lies at ascending positions, so a query reaches its suffix; a
        segment (prefix blocks need not lie in position order) is cut into the runs of keys a member reaches, each
        run one view for the members that reach exactly it. None where own positions do not ascend (the masked path
        takes the pass)."""
        if self.per_row or any(q.numel() != 1 for q in self.query_positions):
            return None
        reach = [int(q[0]) - window for q in self.query_positions]
        own_k, own_v, lens = [], [], []
        for seq, (keys, values, n) in enumerate(zip(own_keys, own_values, own_lens)):
            positions = self.own_positions[seq]
            assert positions.numel() == n, "own positions after the writes, one per own key"
            if positions.numel() > 1 and not bool((positions[1:] >= positions[:-1]).all()):
                return None
            start = int(torch.searchsorted(positions, reach[seq], right=True))
            own_k.append(keys[:, :, start:])
            own_v.append(values[:, :, start:])
            lens.append(n - start)
        seg_k, seg_v, seg_members = [], [], []
        for (keys, values, members, offsets), positions in zip(self.segments, self.segment_positions):
            by_run: dict[tuple[int, int], list[int]] = {}
            for index, seq in enumerate(members):
                if offsets and offsets[index] > 0:
                    continue  # a row offset of 1 or more hides the segment from a sequence's one row
                for run in _runs(positions > reach[seq]):
                    by_run.setdefault(run, []).append(seq)
            for (start, end), seeing in by_run.items():
                seg_k.append(keys[:, :, start:end])
                seg_v.append(values[:, :, start:end])
                seg_members.append(seeing)
        return DecodeParts(own_k, own_v, lens, seg_k, seg_v, seg_members)

    def _parts(self, gather: _Gather, layer: int, own: torch.Tensor, which: int) -> list[torch.Tensor]:
        found = []
        for part, index in gather.parts:
            if part < 0:
                states = own
            else:
                keys, values, _, _ = self.segments[part]
                states = (values if which else keys)[layer]  # [H_kv, n, D]
            if index is None:
                found.append(states)
            elif isinstance(index, slice):
                found.append(states[:, index])  # a view: the one copy is the caller's cat
            else:
                found.append(states.index_select(1, index))
        return found

    def _gathers_of(self, window: int, device: torch.device) -> list[_Gather]:
        key = (window, str(device))
        if key not in self._gathers:
            self._gathers[key] = [self._gather(seq, window, device) for seq in range(len(self.query_positions))]
        return self._gathers[key]

    def _gather(self, seq: int, window: int, device: torch.device) -> _Gather:
        # A key at position k is read by some query of the sequence only if k > (its smallest query position) - W:
        # everything else (whole segments, the front of its own KV) is neither gathered nor attended.
        q_pos = self.query_positions[seq]                                # [T]
        num_q, reach = q_pos.numel(), int(q_pos.min()) - window
        rows = torch.arange(num_q)
        start = sum(p.numel() for p in self.query_positions[:seq])
        parts: list[tuple[int, torch.Tensor | slice | None]] = []
        masks: list[torch.Tensor] = []
        key_positions: list[torch.Tensor] = []  # the gathered keys' positions, parts in order
        hidden = False  # some segment hidden from some row (a row offset)
        for number, ((_, _, members, offsets), positions) in enumerate(zip(self.segments, self.segment_positions)):
            if seq not in members:
                continue
            offset = offsets[members.index(seq)] if offsets else 0
            if offset >= num_q:
                continue  # every query of this pass precedes the segment
            kept = (positions > reach).nonzero()[:, 0]
            if kept.numel() == 0:
                continue
            # In position order (an assembled group's blocks need not lie so): consecutive positions then make a band.
            kept = kept[torch.argsort(positions[kept], stable=True)]
            visible = (rows >= offset)[:, None].expand(num_q, kept.numel())  # today's rule: rows from the offset
            masks.append(visible & (q_pos[:, None] - positions[kept][None, :] < window))
            parts.append((number, _index(kept, positions.numel(), device)))
            key_positions.append(positions[kept])
            hidden |= offset > 0
        own = self.own_positions[seq]                                    # [S]: a prefix, then the T queries' own
        kept = (own > reach).nonzero()[:, 0]
        before = own.numel() - num_q
        # own key c is visible to row r if it precedes the queries (c < before) or is an earlier query (c - before <= r)
        visible = kept[None, :] - before <= rows[:, None]
        masks.append(visible & (q_pos[:, None] - own[kept][None, :] < window))
        parts.append((-1, _index(kept, own.numel(), device)))
        key_positions.append(own[kept])
        keys_at = torch.cat(key_positions)
        band = not hidden and keys_at.numel() > 0 and _run(keys_at) is not None and _run(q_pos) is not None \
            and int(q_pos[-1]) == int(keys_at[-1])
        return _Gather(slice(start, start + num_q), tuple(parts), torch.cat(masks, dim=1).to(device), band)


def _run(values: torch.Tensor) -> slice | None:
    """`slice(v, v + n)` when `values` [n] (n >= 1) are v, v + 1, ..., v + n - 1 (positions at consecutive places,
    indices of one ascending run), else None."""
    first, count = int(values[0]), values.numel()
    if int(values[-1]) - first != count - 1 or not bool((values[1:] - values[:-1] == 1).all()):
        return None
    return slice(first, first + count)


def _index(kept: torch.Tensor, total: int, device: torch.device) -> torch.Tensor | slice | None:
    """How to take the `kept` [k] key indices of `total`, in that order: None for all in order, a slice for an ascending
    run, else an index."""
    if (run := _run(kept)) is not None:
        return None if kept.numel() == total else run
    return kept.to(device)


def _blockwise_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """`_sdpa` in blocks of QUERY_BLOCK rows, each over only the keys some row of it sees: a long prefill's local layer
    then costs rows x (block + W) instead of rows x keys (SDPA computes every masked-out score too)."""
    if q.shape[0] <= QUERY_BLOCK:
        return _sdpa(q, keys, values, mask, scale)
    out = torch.empty_like(q)
    for start in range(0, q.shape[0], QUERY_BLOCK):
        rows = slice(start, start + QUERY_BLOCK)
        seen = mask[rows].any(0).nonzero()[:, 0]  # [m'] the keys this block's rows see (each sees its own)
        if (cols := _run(seen)) is not None:  # one run (keys in position order: a band): views, nothing gathered
            out[rows] = _sdpa(q[rows], keys[:, cols], values[:, cols], mask[rows, cols], scale)
        else:
            out[rows] = _sdpa(q[rows], keys.index_select(1, seen), values.index_select(1, seen), mask[rows][:, seen],
                              scale)
    return out


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
          scale: float) -> torch.Tensor:
    """q [T, H, D] over keys/values [H_kv, m, D] (mask [T, m] bool or None); returns [T, H, D]. The G = H / H_kv query
    heads sharing a KV head are folded into its rows ([H_kv, T G, D]) and the mask made additive: on a CPU that runs
    ~1.3x faster than SDPA's own GQA with a bool mask (a 256-row block of Gemma 3's local layer: 11.8 vs 15.9 ms)."""
    num_rows, num_heads, dim = q.shape
    kv_heads = keys.shape[0]
    group = num_heads // kv_heads
    folded = q.view(num_rows, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(kv_heads, num_rows * group, dim)
    bias = None
    if mask is not None:  # row t g of a head reads what row t does
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        bias = bias.repeat_interleave(group, dim=0)[None, None]  # [1, 1, T G, m]
    out = F.scaled_dot_product_attention(folded[None], keys[None], values[None], attn_mask=bias,
                                         scale=scale)  # [1, H_kv, T G, D]
    return out[0].view(kv_heads, num_rows, group, dim).permute(1, 0, 2, 3).reshape(num_rows, num_heads, dim)


def _runs(kept: torch.Tensor) -> list[tuple[int, int]]:
    """The [start, end) index ranges where `kept` [n] bool is True, in order."""
    if not bool(kept.any()):
        return []
    flags = torch.cat([kept.new_zeros(1), kept, kept.new_zeros(1)]).to(torch.int8)  # [n + 2]
    edges = (flags[1:] - flags[:-1]).nonzero()[:, 0].tolist()  # a run's start (+1), then its end (-1)
    return list(zip(edges[0::2], edges[1::2], strict=True))
