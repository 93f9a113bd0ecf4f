"""Where the fused CPU attention op beats a plain matmul (sets model_runtime/attention/dispatch.py).

    python -m benchmarks.kernels.attention_thresholds [--causal 2 4 9 17 33 64 128 --dtypes float32 bfloat16]

Grid of query rows (folded: sequences x GQA group) x KV length, head_dim 64, 2 KV-head groups, fp32,
2 threads; median microseconds per call for each kernel, JSON lines, and the smallest work
(rows x keys) from which the fused op wins at every larger size. `--causal`: the new tokens' causal block
(T queries over their own T keys, SmolLM2's 9 heads in 3 KV groups), the masked matmul against the fused
op on KV expanded to every head, per dtype: CAUSAL_FUSED_MIN_WORK.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, emit, log, median_ms, setup
from promptcache.model_runtime.attention.backends import fused_cpu_attend, matmul_attend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 64, 256])
    parser.add_argument("--kv", nargs="+", type=int, default=[16, 64, 256, 1024, 4096])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--causal", nargs="*", type=int, default=[], help="new-token counts T to time")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=RESULTS / "attention_thresholds.jsonl")
    args = parser.parse_args()
    setup(args.threads)
    if args.causal:
        causal(args.causal, args.dtypes, args.out)
        return
    wins = []
    for rows in args.rows:
        for kv in args.kv:
            q, k, v = torch.randn(2, rows, 64), torch.randn(2, kv, 64), torch.randn(2, kv, 64)
            times = {}
            for name, kernel in (("matmul", matmul_attend), ("fused_cpu", fused_cpu_attend)):
                times[name] = median_ms(lambda kernel=kernel, q=q, k=k, v=v: kernel(q, k, v, 0.125),
                                        runs=30, warmup=3)[0]
                emit({"bench": "attention_thresholds", "backend": name, "q_rows": rows, "kv_len": kv, "head_dim": 64,
                      "median_us": round(times[name] * 1e3, 1)}, args.out)
            wins.append((rows * kv, times["fused_cpu"] < times["matmul"]))
    wins.sort()
    crossover = next((work for work, _ in wins if all(w for x, w in wins if x >= work)), None)
    log(f"fused op wins at every size from rows x keys = {crossover}")
    emit({"bench": "attention_thresholds", "crossover_work": crossover}, args.out)


def causal(lengths: list[int], dtypes: list[str], out: Path) -> None:
    """The causal square of T new tokens both ways (shared_attention._causal_square), per dtype."""
    from promptcache.model_runtime.attention import dispatch, shared_attention

    configured = dispatch.CAUSAL_FUSED_MIN_WORK
    try:
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            for t in lengths:
                q = torch.randn(t, 9, 64).to(dtype)                                  # [T, H, D]
                k, v = torch.randn(3, t, 64).to(dtype), torch.randn(3, t, 64).to(dtype)  # [H_kv, T, D]
                times = {}
                for name, threshold in (("masked_matmul", 1 << 62), ("fused_cpu", 0)):
                    shared_attention.CAUSAL_FUSED_MIN_WORK = threshold
                    def causal(q=q, k=k, v=v):
                        return shared_attention._causal_square(q, k, v, 3, 0.125, "auto")

                    times[name] = median_ms(causal, runs=200, warmup=20)[0]
                emit({"bench": "causal_threshold", "dtype": dtype_name, "new_tokens": t, "work": t * t * 3,
                      **{f"{name}_us": round(ms * 1e3, 1) for name, ms in times.items()}}, out)
    finally:
        shared_attention.CAUSAL_FUSED_MIN_WORK = configured


if __name__ == "__main__":
    main()
