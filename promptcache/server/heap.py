"""Give freed heap memory back to the OS, periodically (glibc's `malloc_trim`; elsewhere nothing): under many distinct
prompts the RSS grew ~30 MB per 100 prompts with every cache tier within budget, and one trim gave back ~240 MB
(benchmarks/prefix_memory.py, docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


def heap_trimmer() -> Callable[[], None] | None:
    """A function that trims the process heap, or None where the C library has no `malloc_trim`."""
    if not (name := ctypes.util.find_library("c")):
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


async def trim_heap_every(interval_s: float) -> None:
    """Trim the heap every `interval_s` seconds, off the event loop, until cancelled."""
    trim = heap_trimmer()
    if trim is None:
        logger.info("no malloc_trim in this C library: freed heap memory is returned as the allocator decides")
        return
    while True:
        await asyncio.sleep(interval_s)
        started = time.perf_counter()
        await asyncio.to_thread(trim)
        logger.debug("malloc_trim took %.1f ms", (time.perf_counter() - started) * 1e3)
