"""Freed heap memory goes back to the OS (glibc): the server's periodic trim really releases it."""

from __future__ import annotations

import psutil
import pytest
import torch

from promptcache.server.heap import heap_trimmer


def test_trimming_returns_memory_freed_in_small_blocks():
    trim = heap_trimmer()
    if trim is None:
        pytest.skip("this C library has no malloc_trim")
    process = psutil.Process()
    trim()
    before = process.memory_info().rss
    # 64 MB in 32 KiB tensors (a KV block's size; below glibc's mmap threshold, so from the heap) with a
    # small survivor after each: freeing the big ones leaves holes that the heap's top cannot shrink past.
    blocks = [torch.ones(8192) for _ in range(2048)]
    survivors = [torch.ones(4) for _ in blocks]
    grown = process.memory_info().rss
    del blocks
    kept = process.memory_info().rss
    trim()
    trimmed = process.memory_info().rss
    assert grown - before > 48e6  # the allocation was real
    assert kept - before > 32e6  # freed, yet still resident: what the server saw
    assert trimmed - before < 16e6, (before, grown, kept, trimmed)
    assert len(survivors) == 2048
