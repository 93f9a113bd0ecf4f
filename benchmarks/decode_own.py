"""Decode with long own KV: the padded batch call (gathers every sequence's own KV from the pool each layer
of each step) vs reading it in place (one fused call per long sequence), side by side in one run.

    python -m benchmarks.decode_own --own 64 1024 2048 --batch 32 --shared 512

Qwen2.5-0.5B shape, random weights, `--dtype` and weight packing as the server (decode.py), 2 threads, the engine's ModelRunner (benchmarks/decode.py's
`shared` mode). `padded` forces every decoding sequence through the padded call (the engine before
this change); `in_place` is the engine's dispatch (attention/dispatch.py: in place from 128 own keys);
`noattention` is the ceiling (attention output := query). A `mix` case gives each sequence 2 of 4 shared
512-token blocks (sequences sharing different subsets), at the largest own length.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from benchmarks.decode import _kv, _no_attention, load_shape, model_args, pooled_sequences, run_mode
from benchmarks.harness import RESULTS, emit, log, setup
from promptcache.cache_store import KVBlock
from promptcache.model_runtime.attention import dispatch
from promptcache.model_runtime.engine.request import SharedKV
from promptcache.model_runtime.engine.runner import ModelRunner


def run_mix(loaded, batch: int, own: int, steps: int, block_tokens: int = 512) -> dict:
    """Each sequence imports 2 of 4 shared blocks (6 distinct pairs), plus `own` tokens of its own."""
    layers, kv_heads, head_dim, dtype = loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, loaded.model.dtype
    blocks = [SharedKV(f"m{j}", KVBlock(_kv(layers, kv_heads, block_tokens, head_dim, dtype=dtype),
                                        _kv(layers, kv_heads, block_tokens, head_dim, dtype=dtype), torch.arange(block_tokens)))
              for j in range(4)]
    pairs = [(a, b) for a in range(4) for b in range(a + 1, 4)]
    runner = ModelRunner(loaded)
    seqs = pooled_sequences(loaded, [[blocks[a], blocks[b]] for a, b in (pairs[i % len(pairs)] for i in range(batch))],
                            own + steps, own)
    with torch.inference_mode():
        for t in range(steps):
            if t == 1:
                started = time.perf_counter()  # step 0 is the warm-up
            for seq in seqs:
                seq.pending_ids, seq.pending_positions = [t % 1000], [2 * block_tokens + own + t]
            runner.run(seqs)
    elapsed = time.perf_counter() - started
    return {"batch": batch, "own_tokens": own, "shared_tokens": 2 * block_tokens,
            "tokens_per_s": round(batch * (steps - 1) / elapsed, 2), "ms_per_step": round(elapsed / (steps - 1) * 1e3, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--own", nargs="+", type=int, default=[64, 1024, 2048])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--shared", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "decode_own.jsonl")
    model_args(parser)
    args = parser.parse_args()
    setup(args.threads)
    AttentionInterface.register("bench_noattention", _no_attention)
    AttentionMaskInterface.register("bench_noattention", sdpa_mask)
    model, loaded = load_shape(args)
    in_place_min = dispatch.OWN_DECODE_FUSED_MIN_KEYS
    records = []

    def measure(mode: str, run) -> dict:
        dispatch.OWN_DECODE_FUSED_MIN_KEYS = 1 << 62 if mode.startswith("padded") else in_place_min
        try:
            record = {"bench": "decode_own", "shape": "qwen2.5-0.5b", "mode": mode,
                      "dtype": str(model.dtype).removeprefix("torch."), **run()}
        finally:
            dispatch.OWN_DECODE_FUSED_MIN_KEYS = in_place_min
        emit(record, args.out)
        records.append(record)
        return record

    for own in args.own:
        row = {mode: measure(mode, lambda m=mode, own=own: {k: v for k, v in run_mode(
            "noattention" if m == "noattention" else "shared", model, loaded, args.batch, args.shared, own,
            args.steps).items() if k != "mode"})["tokens_per_s"] for mode in ("padded", "in_place", "noattention")}
        log(f"own {own}: in_place/padded = {row['in_place'] / row['padded']:.2f}x, "
            f"in_place/noattention = {row['in_place'] / row['noattention']:.2f}")
    own = max(args.own)
    mix = {mode: measure(mode, lambda: run_mix(loaded, args.batch, own, args.steps))["tokens_per_s"]
           for mode in ("padded_mix", "in_place_mix")}
    log(f"mix own {own}: in_place/padded = {mix['in_place_mix'] / mix['padded_mix']:.2f}x")
    plot(records, args.out.with_suffix(".png"), str(model.dtype).removeprefix("torch."))


def plot(records: list[dict], path: Path, dtype: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for mode in ("padded", "in_place", "noattention"):
        rows = sorted((r for r in records if r["mode"] == mode), key=lambda r: r["own_tokens"])
        ax.plot([r["own_tokens"] for r in rows], [r["tokens_per_s"] for r in rows], "o-", label=mode)
    ax.set_xlabel("own tokens per sequence")
    ax.set_ylabel("decode tokens/s (batch 32)")
    ax.set_title(f"Decode with long own KV, Qwen2.5-0.5B shape, CPU {dtype}, 2 threads", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
