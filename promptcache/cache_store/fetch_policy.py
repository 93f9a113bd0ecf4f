"""FetchPolicy: whether reading a block from a shared tier beats recomputing its tokens."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class Throughput:
    """EMA of a rate; `None` until the first sample."""

    alpha: float = 0.2
    value: float | None = None

    def add(self, amount: float, seconds: float) -> None:
        if seconds > 0 and amount > 0:
            rate = amount / seconds
            self.value = rate if self.value is None else (1 - self.alpha) * self.value + self.alpha * rate


@dataclass
class FetchPolicy:
    """Whether reading a block of `nbytes` from a tier beats the `num_tokens` of prefill that recompute it,
    from online averages of each tier's read rate (bytes/s) and the runtime's prefill rate (tokens/s).
    Unknown rates are optimistic (fetch), so measurements can accumulate."""

    margin: float = 1.0  # fetch only if fetch_s * margin < recompute_s
    tiers: dict[str, Throughput] = field(default_factory=dict)
    recompute: Throughput = field(default_factory=Throughput)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_fetch(self, tier: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.tiers.setdefault(tier, Throughput()).add(nbytes, seconds)

    def record_recompute(self, num_tokens: int, seconds: float) -> None:
        with self._lock:
            self.recompute.add(num_tokens, seconds)

    def worth_fetching(self, tier: str, nbytes: int, num_tokens: int | None) -> bool:
        with self._lock:
            read = self.tiers.get(tier)
            return (num_tokens is None or read is None or read.value is None or self.recompute.value is None
                    or nbytes / read.value * self.margin < num_tokens / self.recompute.value)
