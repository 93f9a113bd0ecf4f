"""KVPool: the engine's sequences' own KV as slot ranges of one pair of tensors, so a step writes every
sequence's new keys with one `index_copy_` per layer (on a GPU each copy is a kernel launch)."""

from __future__ import annotations

import bisect

import torch


class KVPool:
    """`keys`/`values` [L, H_kv, num_slots, D], made at the first `allocate` (unused CPU pages cost address space only).
    A range is owned from `allocate` to `free`, then reused at once."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.shape = (num_layers, num_kv_heads, num_slots, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self._free: list[tuple[int, int]] = [(0, num_slots)]  # (first, end), sorted, never adjacent
        self._sizes: dict[int, int] = {}  # first slot of each allocated range -> its size

    @property
    def keys(self) -> torch.Tensor:
        return self._tensors()[0]

    @property
    def values(self) -> torch.Tensor:
        return self._tensors()[1]

    @property
    def num_free(self) -> int:
        """Slots not allocated (possibly in several ranges)."""
        return sum(end - first for first, end in self._free)

    def allocate(self, num_slots: int) -> int | None:
        """The first slot of a free range of `num_slots` (first fit), or None when no range is that long."""
        for i, (first, end) in enumerate(self._free):
            if end - first >= num_slots:
                self._tensors()
                if end - first == num_slots:
                    del self._free[i]
                else:
                    self._free[i] = (first + num_slots, end)
                self._sizes[first] = num_slots
                return first
        return None

    def free(self, first: int) -> None:
        """Return the range that starts at `first` (merged with free neighbours)."""
        end = first + self._sizes.pop(first)
        i = bisect.bisect(self._free, (first, end))
        if i < len(self._free) and self._free[i][0] == end:  # the next free range follows on
            end = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == first:  # the previous one ends here
            i -= 1
            first = self._free.pop(i)[0]
        self._free.insert(i, (first, end))

    def slots(self, first: int, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the keys and values of slots [first, first + num_slots)."""
        return self.keys[:, :, first: first + num_slots], self.values[:, :, first: first + num_slots]

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._kv is None:
            self._kv = (torch.empty(self.shape, dtype=self.dtype, device=self.device),
                        torch.empty(self.shape, dtype=self.dtype, device=self.device))
        return self._kv
