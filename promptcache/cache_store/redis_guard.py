"""Failure policy for Redis calls: a failure is a miss plus a rate-limited warning, then a back-off."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis

logger = logging.getLogger("promptcache.cache_store")
T = TypeVar("T")


class RedisGuard:
    """Runs Redis calls; after a failure, skips Redis for `retry_interval_s` so a dead server costs at
    most one bounded timeout per interval, then tries again (and uses it again once it answers)."""

    def __init__(self, what: str, retry_interval_s: float = 2.0, warn_interval_s: float = 30.0) -> None:
        self.what = what
        self.retry_interval_s = retry_interval_s
        self.warn_interval_s = warn_interval_s
        self._down_until = 0.0
        self._last_warning = -1e9
        self._lock = threading.Lock()

    @property
    def is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def call(self, fn: Callable[[], T], default: T) -> T:
        if self.is_down:
            return default
        try:
            return fn()
        except (redis.RedisError, OSError) as exc:
            now = time.monotonic()
            with self._lock:
                self._down_until = now + self.retry_interval_s
                if now - self._last_warning >= self.warn_interval_s:
                    self._last_warning = now
                    logger.warning("%s unavailable (%s: %s); treating as a miss, retrying in %.1fs",
                                   self.what, type(exc).__name__, exc, self.retry_interval_s)
            return default
