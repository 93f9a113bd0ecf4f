"""When is fetching a block from a slow tier cheaper than recomputing it? Measured online.

Each tier's read throughput (bytes/s) is tracked as an exponential moving average of real fetches;
the runtime reports its prefill throughput (tokens/s). A lookup may skip a shared tier whose expected
fetch time exceeds the expected recompute time. On CPU, recompute is so slow that every tier pays off
(see docs/benchmarks.md, `benchmarks/engine/store.py`); on a fast GPU next to a distant Redis it may not.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class Throughput:
    """EMA of a rate; `None` until the first sample."""

    alpha: float = 0.2
    value: float | None = None

    def add(self, amount: float, seconds: float) -> None:
        if seconds <= 0 or amount <= 0:
            return
        rate = amount / seconds
        self.value = rate if self.value is None else (1 - self.alpha) * self.value + self.alpha * rate


@dataclass
class FetchPolicy:
    """Decides whether a tier is worth reading for a block of `nbytes` that would take `num_tokens` of
    prefill to recompute. Unknown rates are optimistic (fetch), so measurements can accumulate."""

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
            if num_tokens is None or read is None or read.value is None or self.recompute.value is None:
                return True
            return nbytes / read.value * self.margin < num_tokens / self.recompute.value
