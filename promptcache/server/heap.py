"""Give freed heap memory back to the OS, periodically (glibc only).

glibc's malloc keeps freed memory in its arenas: under many distinct prompts (KV blocks evicted and stored, prefill
temporaries of varying sizes) the server's RSS kept growing by ~30 MB per 100 prompts while every cache tier stayed
within its byte budget, and one `malloc_trim(0)` gave back ~240 MB (benchmarks/prefix_memory.py, docs/benchmarks.md).
Other C libraries (musl, macOS) return memory differently and have no `malloc_trim`: there this does nothing."""

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
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
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
