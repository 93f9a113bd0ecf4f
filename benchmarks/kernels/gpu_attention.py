"""Attention alone, one layer of a decode step: shared-module attention vs per-sequence SDPA.

    python -m benchmarks.kernels.gpu_attention --device cuda            # B = 32, 8K shared + 256 own, bf16
    python -m benchmarks.kernels.gpu_attention --device cpu --smoke     # tiny, to check the script

TinyLlama-1.1B head shape (32 query / 4 KV heads, head dim 64). Modes, side by side:
- per_sequence_sdpa: every sequence holds its own copy of the shared KV, [B, H_kv, P + S, D], attended
  by torch SDPA with native GQA (what a server without shared-prefix attention does);
- shared: `shared_module_attention` as the engine calls it (own KV in a pool, index tensors built once
  per pass; the shared KV once for all B queries, split over its keys when one call would not fill the
  GPU, merged with each sequence's own KV);
- shared_unsplit: the same without split-K;
- no_attention: the output is a copy of the queries (the floor: launch and copy cost only);
- triton: the same arithmetic as `shared` in two Triton kernels (triton_decode.py, a prototype; on a
  CUDA device with Triton only).
Prints JSON lines (median of `--iters` timed calls after warm-up; CUDA events on a GPU) with the bytes
each mode reads and the bandwidth that implies; on a GPU each mode also replayed from a CUDA graph
(`timing: cuda_graph`: the device's time without the host's launch cost).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.harness import device_name, emit, gpu_parser, log
from promptcache.model_runtime.attention import OwnPool, SharedSegment, StepIndices, shared_module_attention, split_keys

HEADS, KV_HEADS, HEAD_DIM = 32, 4, 64


def time_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of `fn` (CUDA events on a GPU, wall clock on a CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def graph_ms(fn: Callable[[], object], device: torch.device, iters: int, calls: int = 10) -> float | None:
    """Median milliseconds of one call of `fn` replayed from a CUDA graph of `calls` calls: the device's time
    without the host's launch cost (what a decode step captured as a graph would pay). None where `fn` cannot
    be captured (a host sync or a pageable copy inside it)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception as error:  # torch raises several kinds for an illegal call under capture
        log(f"not capturable: {str(error).splitlines()[0]}")
        return None
    return time_ms(graph.replay, device, iters) / calls


def run(device: torch.device, dtype: torch.dtype, batch: int, shared: int, own: int, iters: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    queries = rand(batch, HEADS, HEAD_DIM)                                    # [B, H, D]
    shared_k, shared_v = rand(KV_HEADS, shared, HEAD_DIM), rand(KV_HEADS, shared, HEAD_DIM)
    # Own KV as the engine keeps it: slots of one pool, sequence b's at b * own (views, no copies).
    pool_k, pool_v = rand(KV_HEADS, batch * own, HEAD_DIM), rand(KV_HEADS, batch * own, HEAD_DIM)
    own_k = [pool_k[:, b * own:(b + 1) * own] for b in range(batch)]          # per sequence [H_kv, S, D]
    own_v = [pool_v[:, b * own:(b + 1) * own] for b in range(batch)]
    pool = OwnPool(pool_k, pool_v, tuple(b * own for b in range(batch)))
    indices = StepIndices(device)  # a forward pass's index tensors, built once and shared by its layers
    segment = SharedSegment(shared_k, shared_v, tuple(range(batch)))
    # Per-sequence layout: the shared KV copied into every sequence's buffer.
    full_k = torch.cat([shared_k.expand(batch, -1, -1, -1), torch.stack(own_k)], dim=2)  # [B, H_kv, P + S, D]
    full_v = torch.cat([shared_v.expand(batch, -1, -1, -1), torch.stack(own_v)], dim=2)
    q4 = queries.unsqueeze(2)                                                 # [B, H, 1, D]
    scale = HEAD_DIM ** -0.5

    def shared_call() -> torch.Tensor:
        return shared_module_attention(queries, [1] * batch, own_k, own_v, [segment], scale=scale, indices=indices,
                                       own_pool=pool)

    def per_sequence() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q4, full_k, full_v, scale=scale, enable_gqa=True)

    reference = per_sequence()[:, :, 0].float()
    element = torch.finfo(dtype).bits // 8
    kv_bytes = {"per_sequence_sdpa": 2 * batch * KV_HEADS * (shared + own) * HEAD_DIM * element,
                "shared": 2 * KV_HEADS * (shared + batch * own) * HEAD_DIM * element}
    kv_bytes["shared_unsplit"] = kv_bytes["shared"]
    kv_bytes["no_attention"] = 0
    modes: dict[str, Callable[[], object]] = {"per_sequence_sdpa": per_sequence, "shared": shared_call,
                                              "no_attention": queries.clone}
    fused = _triton_call(queries, shared_k, shared_v, pool_k, pool_v, batch, own, scale)
    if fused is not None:
        modes["triton"] = fused
        kv_bytes["triton"] = kv_bytes["shared"]
    errors = {mode: round((fn().float() - reference).abs().max().item(), 5) for mode, fn in modes.items()
              if mode not in ("per_sequence_sdpa", "no_attention")}
    times = {mode: time_ms(fn, device, iters) for mode, fn in modes.items()}
    # The engine's torch-op call last: a failed capture may leave the device unusable for the ones after it.
    order = sorted(modes, key=lambda mode: mode == "shared")
    graphed = {mode: graph_ms(modes[mode], device, iters) for mode in order} if device.type == "cuda" else {}
    keep = split_keys.MIN_KEYS_PER_SPLIT
    split_keys.MIN_KEYS_PER_SPLIT = 1 << 62  # no split-K
    try:
        times["shared_unsplit"] = time_ms(shared_call, device, iters)
    finally:
        split_keys.MIN_KEYS_PER_SPLIT = keep
    records = []
    for mode, ms in times.items():
        records.append({
            "bench": "gpu_attention", "mode": mode, "device": device_name(device), "dtype": str(dtype)[6:],
            "batch": batch, "shared_tokens": shared, "own_tokens": own, "heads": HEADS, "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM, "ms": round(ms, 4), "kv_bytes": kv_bytes[mode],
            "gb_per_s": round(kv_bytes[mode] / ms / 1e6, 1) if kv_bytes[mode] else None,
            "speedup_vs_per_sequence": round(times["per_sequence_sdpa"] / ms, 2),
            "max_abs_error_vs_sdpa": errors.get(mode, errors["shared"]), "iters": iters, "timing": "eager"})
    baseline = graphed.get("per_sequence_sdpa")
    for mode, graph_time in graphed.items():
        records.append({**next(r for r in records if r["mode"] == mode), "timing": "cuda_graph",
                        "ms": None if graph_time is None else round(graph_time, 4),
                        "gb_per_s": round(kv_bytes[mode] / graph_time / 1e6, 1) if graph_time and kv_bytes[mode]
                        else None,
                        "speedup_vs_per_sequence": round(baseline / graph_time, 2) if baseline and graph_time
                        else None})
    return records


def _triton_call(queries, shared_k, shared_v, pool_k, pool_v, batch: int, own: int,
                 scale: float) -> Callable[[], torch.Tensor] | None:
    """The `triton` mode's call, or None without a CUDA device or Triton."""
    if queries.device.type != "cuda":
        return None
    try:
        from benchmarks.kernels.triton_decode import BLOCK_ROWS, shared_decode_attention
    except ImportError:
        return None
    first = torch.arange(batch, dtype=torch.int32, device=queries.device) * own
    length = torch.full((batch,), own, dtype=torch.int32, device=queries.device)
    # Key chunks enough for every SM: programs = KV heads x row blocks x chunks.
    programs = KV_HEADS * -(-batch * (HEADS // KV_HEADS) // BLOCK_ROWS)
    chunks = max(1, min(split_keys.num_sms(queries.device) // programs, shared_k.shape[1] // 256))
    return lambda: shared_decode_attention(queries, shared_k, shared_v, pool_k, pool_v, first, length, scale, chunks)


def main() -> None:
    parser = gpu_parser(__doc__, "attention.jsonl", "tiny sizes, few iterations (checks the script)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--shared", type=int, default=8192)
    parser.add_argument("--own", type=int, default=256)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.shared, args.own, args.iters = 4, 1024, 16, 3
    device = torch.device(args.device)
    with torch.inference_mode():
        records = run(device, getattr(torch, args.dtype), args.batch, args.shared, args.own, args.iters)
    for record in records:
        emit(record, args.out)
    by_mode = {r["mode"]: r["ms"] for r in records if r["timing"] == "eager"}
    log(f"shared {by_mode['per_sequence_sdpa'] / by_mode['shared']:.2f}x per-sequence SDPA "
        f"(unsplit {by_mode['per_sequence_sdpa'] / by_mode['shared_unsplit']:.2f}x)")
    for record in records:
        if record["timing"] == "cuda_graph":
            log(f"CUDA graph: {record['mode']} {record['ms']} ms ({record['speedup_vs_per_sequence']}x)")


if __name__ == "__main__":
    main()
