"""What the GPU benchmarks share: their common command-line arguments and the device's name."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.harness import RESULTS


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
