"""Index tensors of one forward pass, built on the host once and reused by every layer: on a GPU a tensor made
from a Python list, or a length read back, stalls the host each layer; these are copied from pinned memory
without blocking, once per pass."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device` without a host sync (pinned, copied asynchronously); on the CPU as it is."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class StepIndices:
    """Device index tensors of one forward pass, by key; `get` builds each on the host at first use."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._made: dict[Hashable, torch.Tensor] = {}

    def get(self, key: Hashable, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The tensor `build()` makes on the host, on this pass's device (built once per key)."""
        found = self._made.get(key)
        if found is None:
            found = self._made[key] = to_device(build(), self.device)
        return found

    def rows(self, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
        """int64 [sum of lengths]: the rows first..end-1 of each (first, end) span, in order."""
        spans = tuple(spans)
        return self.get(("rows", spans), lambda: _span_rows(spans))

    def span(self, spans: Sequence[tuple[int, int]]) -> slice | torch.Tensor:
        """The rows of (first, end) `spans` as one slice where they follow on (a view: no copies), else `rows`."""
        if spans and all(spans[j][1] == spans[j + 1][0] for j in range(len(spans) - 1)):
            return slice(spans[0][0], spans[-1][1])
        return self.rows(spans)

    def positions(self, rows: Sequence[int]) -> torch.Tensor:
        """int64 [len(rows)]: the given rows."""
        rows = tuple(rows)
        return self.get(("at", rows), lambda: torch.tensor(rows, dtype=torch.long))


def _span_rows(spans: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """`StepIndices.rows` on the host in a few ops, however many spans (one per sequence in a step)."""
    if not spans:
        return torch.empty(0, dtype=torch.long)
    firsts, ends = torch.tensor(spans, dtype=torch.long).unbind(1)  # [num_spans] each
    lengths = ends - firsts
    # Output element k lies in span s at k - (where span s starts in the output): row firsts[s] + that.
    shifts = firsts - (torch.cumsum(lengths, 0) - lengths)
    return torch.arange(sum(end - first for first, end in spans)) + torch.repeat_interleave(shifts, lengths)
