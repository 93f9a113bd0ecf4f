"""Freed heap memory goes back to the OS (glibc): the server's periodic trim really releases it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from promptcache.server.heap import heap_trimmer

# Run in a fresh interpreter: how much freed memory glibc keeps depends on the allocation history of the
# process, which inside a test session is everything that ran before.
PROBE = """
import json, psutil, torch
from promptcache.server.heap import heap_trimmer
trim, process = heap_trimmer(), psutil.Process()
trim()
before = process.memory_info().rss
# 64 MB in 32 KiB tensors (a KV block's size; below glibc's mmap threshold, so from the heap) with a small
# survivor after each: freeing the big ones leaves holes the heap's top cannot shrink past.
blocks = [torch.ones(8192) for _ in range(2048)]
survivors = [torch.ones(4) for _ in blocks]
grown = process.memory_info().rss
del blocks
kept = process.memory_info().rss
trim()
print(json.dumps({"grown": grown - before, "kept": kept - before, "trimmed": process.memory_info().rss - before}))
"""


def test_trimming_returns_memory_freed_in_small_blocks():
    if heap_trimmer() is None:
        pytest.skip("this C library has no malloc_trim")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    assert rss["grown"] > 48e6, rss  # the allocation was real
    assert rss["kept"] > 32e6, rss  # freed, yet still resident: what the server saw
    assert rss["trimmed"] < 16e6, rss  # given back
