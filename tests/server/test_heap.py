"""Memory housekeeping: freed heap memory goes back to the OS (glibc), and what lives as long as the
process is kept out of the garbage collector's full collections."""

from __future__ import annotations

import gc
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


def test_startup_freezes_what_lives_for_the_process(live_server):
    """Once the model is loaded and the engine started, everything alive then (model, tokenizer, libraries)
    is in the collector's permanent generation: a full collection mid-stream would otherwise walk it all
    while holding the GIL. Objects made afterwards are still collected."""
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    live_server()
    frozen = gc.get_freeze_count()
    assert frozen > 10_000  # the model's modules and tensors, the tokenizer, FastAPI, torch
    collected = []
    gc.callbacks.append(lambda phase, info: collected.append(info["collected"]) if phase == "stop" else None)
    try:
        cycle: list = []
        cycle.append(cycle)
        del cycle  # made after startup: a full collection still finds it
        gc.collect()
    finally:
        gc.callbacks.pop()
    assert collected and collected[-1] >= 1 and gc.get_freeze_count() <= frozen
