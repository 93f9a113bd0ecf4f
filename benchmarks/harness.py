"""Benchmark plumbing: thread count, medians after warm-up, JSON lines out, the GPU scripts' arguments."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def setup(threads: int) -> None:
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)


def median_ms(fn: Callable[[], object], *, runs: int, warmup: int = 1) -> tuple[float, list[float]]:
    """Run `fn` warmup + runs times; return the median and all timed runs in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times), times


def emit(record: dict, out: Path | None = None) -> None:
    """Print one JSON line (and append it to `out`). `torch_threads` is this thread's unless the record names it
    (a benchmark whose engine thread runs the torch work, as in the server, gives the engine's)."""
    record = {"torch_threads": torch.get_num_threads(), "machine": platform.machine(), **record}
    line = json.dumps(record, sort_keys=True)
    print(line, flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as fh:
            fh.write(line + "\n")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def gpu_parser(doc: str | None, out_name: str, smoke_help: str) -> argparse.ArgumentParser:
    """A parser with --device, --dtype, --smoke and --out (results/gpu/<out_name> by default)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu" / out_name)
    return parser


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
