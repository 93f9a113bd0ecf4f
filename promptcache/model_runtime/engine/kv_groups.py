"""AssembledGroups: shared KV blocks concatenated once per group, kept across steps and requests."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from promptcache.cache_store import KVBlock
from promptcache.model_runtime.engine.prefix import KVView
from promptcache.model_runtime.rope_shift import KeyShifter

HEADROOM = 1.25  # a new buffer holds this much more than its group, so a somewhat larger group can reuse it


@dataclass(eq=False, slots=True)
class _Group:
    keys: torch.Tensor    # [L, H_kv, n, D]: a contiguous view of the front of `buffer`'s first half
    values: torch.Tensor  # [L, H_kv, n, D]: ... of its second half
    buffer: torch.Tensor  # [2, capacity] flat, model dtype
    positions: torch.Tensor | None = None  # [n] int64 host: the keys' positions, once asked for

    @property
    def num_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class AssembledGroups:
    """Concatenations of shared blocks the same sequences attend together, named by their blocks (one kernel call per
    layer, not per block). Kept while in use, then LRU within `max_bytes`; past the budget a new group takes an old
    one's buffer (fresh tensors page-fault: ~15 ms on 2 cores for a 2.3K-token 135M prompt); after `reserve`, new
    buffers are first carved from memory touched at startup (held until its last group is dropped: with it, the groups
    hold at most twice `max_bytes`). `split` keeps whole blocks
    apart from views, which differ per request; `shifter` applies a view's `shift` as keys are copied."""

    def __init__(self, max_bytes: int, shifter: KeyShifter | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.shifter = shifter
        self._groups: OrderedDict[tuple[KVView, ...], _Group] = OrderedDict()
        self._live: set[tuple[KVView, ...]] = set()
        self._reserve: torch.Tensor | None = None  # [2, capacity]: memory touched ahead, new buffers carved from it

    def reserve(self, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate and touch the budget's memory now (at startup), so that new groups are carved from memory already
        backed: the first touch of fresh memory is what a first group costs (on the 2-core VM of docs/benchmarks.md,
        filling a fresh 100 MB buffer took 164 ms, the same buffer again 3.7 ms)."""
        capacity = self.max_bytes // (2 * dtype.itemsize)
        self._reserve = torch.zeros((2, capacity), dtype=dtype, device=device) if capacity > 0 else None

    @property
    def num_bytes(self) -> int:
        """Bytes held by the groups' buffers."""
        return sum(g.num_bytes for g in self._groups.values())

    def __len__(self) -> int:
        return len(self._groups)

    def kept(self) -> list[tuple[KVView, ...]]:
        """Names of the groups held, least recently used first."""
        return list(self._groups)

    @staticmethod
    def split(names: Seq[KVView]) -> list[tuple[KVView, ...]]:
        """The parts a group of blocks is attended in: its whole blocks and its other views apart when
        there are at least two whole blocks and some other view; otherwise all together. Sorted in each part."""
        whole = tuple(sorted((n for n in names if n.is_whole), key=KVView.order))
        views = tuple(sorted((n for n in names if not n.is_whole), key=KVView.order))
        if len(whole) >= 2 and views:
            return [whole, views]
        return [tuple(sorted(names, key=KVView.order))]

    def get(self, names: tuple[KVView, ...], blocks: Mapping[KVView, KVBlock]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [L, H_kv, sum n, D] of the blocks `names`, keys moved by each view's `shift` (one
        unshifted block: its own tensors). Marks the group in use until the next `trim`."""
        if len(names) == 1 and not names[0].shift:
            block = blocks[names[0]]
            return block.keys, block.values
        self._live.add(names)
        group = self._groups.get(names)
        if group is not None:
            self._groups.move_to_end(names)
            return group.keys, group.values
        parts = [blocks[n] for n in names]
        first = parts[0].keys
        shape = (*first.shape[:2], sum(p.keys.shape[2] for p in parts), first.shape[3])  # [L, H_kv, sum n, D]
        numel = math.prod(shape)
        buffer = self._buffer(numel, first.dtype, first.device)
        keys, values = buffer[0, :numel].view(shape), buffer[1, :numel].view(shape)  # contiguous views
        if any(n.shift for n in names):
            assert self.shifter is not None, "shifted blocks need a model whose positions are RoPE"
            offset = 0
            for name, part in zip(names, parts):
                n = part.keys.shape[2]
                target = keys[:, :, offset: offset + n]
                if name.shift:
                    self.shifter.shift_into(target, part.keys, torch.full((n,), name.shift, device=target.device))
                else:
                    target.copy_(part.keys)
                offset += n
        else:
            torch.cat([p.keys for p in parts], dim=2, out=keys)
        torch.cat([p.values for p in parts], dim=2, out=values)
        self._groups[names] = _Group(keys, values, buffer)
        return keys, values

    def positions(self, names: tuple[KVView, ...], blocks: Mapping[KVView, KVBlock]) -> torch.Tensor:
        """Positions [sum n] (host, int64) of the keys `get` concatenates for `names`: each block's own positions moved
        by its view's shift. Kept with the group: a model with sliding windows asks for them every step (a 70-block
        document's took ~0.45 ms a decode step)."""
        group = self._groups.get(names)
        if group is not None and group.positions is not None:
            return group.positions
        found = torch.cat([blocks[n].position_ids.cpu() + n.shift for n in names])
        if group is not None:
            group.positions = found
        return found

    def trim(self) -> None:
        """After a step's gets: drop LRU groups the step did not use while over budget; forget what it used."""
        live, self._live = self._live, set()
        held = self.num_bytes
        for names in list(self._groups):
            if held <= self.max_bytes:
                break
            if names not in live:
                held -= self._groups.pop(names).num_bytes

    def release(self) -> None:
        """Drop every group and the reserve (a stopped engine's)."""
        self._groups.clear()
        self._live.clear()
        self._reserve = None

    def _buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A [2, >= numel] buffer (each half contiguous): the reserve's front while the reserve is large enough, else a
        new one (with headroom) while the budget allows it, else the buffer of the least recently used group not in
        use that is large enough (that group is dropped)."""
        size = int(numel * HEADROOM)
        reserve = self._reserve
        if (reserve is not None and reserve.dtype == dtype and reserve.device == device
                and reserve.shape[1] >= numel):  # its front, with headroom where it fits; the rest stays reserved
            size = min(size, reserve.shape[1])
            self._reserve = reserve[:, size:] if reserve.shape[1] > size else None
            return reserve[:, :size]
        if self.num_bytes + 2 * size * dtype.itemsize > self.max_bytes:
            for names, group in self._groups.items():
                buffer = group.buffer
                if (names not in self._live and buffer.shape[1] >= numel and buffer.dtype == dtype
                        and buffer.device == device):
                    del self._groups[names]
                    return buffer
        return torch.empty((2, size), dtype=dtype, device=device)
