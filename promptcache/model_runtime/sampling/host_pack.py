"""A step's small sampling inputs (row indices, token ids, per-row parameters) packed on the host into one buffer
and copied to the device once: one transfer, however many rows and sections."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from promptcache.model_runtime.attention.step_indices import to_device


class HostPack:
    """Named int and float sections, gathered on the host; `to` copies them all to a device in one transfer."""

    def __init__(self) -> None:
        self._ints: list[int] = []
        self._floats: list[float] = []
        self._int_spans: dict[str, tuple[int, int]] = {}
        self._float_spans: dict[str, tuple[int, int]] = {}

    def ints(self, name: str, values: Iterable[int]) -> None:
        start = len(self._ints)
        self._ints.extend(values)
        self._int_spans[name] = (start, len(self._ints))

    def floats(self, name: str, values: Iterable[float]) -> None:
        start = len(self._floats)
        self._floats.extend(values)
        self._float_spans[name] = (start, len(self._floats))

    def to(self, device: torch.device) -> DevicePack:
        """Every section on `device` from one int64 buffer (pinned on CUDA, copied without blocking the host).
        Floats travel as float64 bits and become float32 there: the same rounding as a Python float scalar
        meeting a float32 tensor, so the arithmetic matches per-sequence code that used Python scalars."""
        floats = torch.tensor(self._floats, dtype=torch.float64).view(torch.int64)  # [num_floats]
        host = torch.cat([torch.tensor(self._ints, dtype=torch.int64), floats])      # [num_ints + num_floats]
        buffer = to_device(host, device)
        return DevicePack(buffer[: len(self._ints)], buffer[len(self._ints):].view(torch.float64).float(),
                          self._int_spans, self._float_spans)


class DevicePack:
    """The sections of a HostPack on the device: views of one buffer (floats: one float32 conversion)."""

    def __init__(self, ints: torch.Tensor, floats: torch.Tensor, int_spans: dict[str, tuple[int, int]],
                 float_spans: dict[str, tuple[int, int]]) -> None:
        self._ints, self._floats = ints, floats  # [num_ints] int64, [num_floats] float32
        self._int_spans, self._float_spans = int_spans, float_spans

    def ints(self, name: str) -> torch.Tensor:
        """int64 [len(section)]."""
        start, end = self._int_spans[name]
        return self._ints[start:end]

    def floats(self, name: str) -> torch.Tensor:
        """float32 [len(section)]."""
        start, end = self._float_spans[name]
        return self._floats[start:end]
