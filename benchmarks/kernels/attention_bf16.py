"""bf16 attention on a CPU with avx512_bf16 but no AMX: the engine's kernel against torch's fused CPU op.

    python -m benchmarks.kernels.attention_bf16 [--flex]

Without AMX, torch's fused CPU attention computes bf16 inputs in fp32, so bf16 attention runs at fp32
speed while the linears run ~2.2x faster (what held `--dtype auto` under 2x on a cold prefill before the
engine had its own kernel). Another candidate: attention as oneDNN bf16 GEMMs (which do use avx512_bf16) plus a bf16
softmax, in query blocks, with the log-sum-exp the shared-module merge needs (m - log(max p): exact up to
the rounding of p). Timed against the fused op in fp32 and bf16 on the two shapes that bound the bf16
serving and decode targets:
- prefill: the causal square of 2,048 new tokens, SmolLM2-135M's 9 heads (KV expanded, as the engine does);
- decode: one shared 8K-token segment attended by 32 sequences (Qwen2.5-0.5B: 2 KV heads, 7 query heads
  each, folded into 224 rows per KV head).
`promptcache_bf16` is the engine's own kernel (model_runtime/attention/bf16_kernel.py; timed when this CPU
can build it). `--flex` adds torch.compile'd flex_attention (its compile time reported; on CPU it cannot
return the lse, which the engine's merge needs, so it is timed without). Error: max |out - fp32 fused| and
max |lse - fp32 fused|. Median ms of 7 runs, one JSON line per kernel and shape.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, emit, log, median_ms, setup
from promptcache.model_runtime.attention import bf16_kernel

FUSED = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def gemm_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [G, M, D] (scale folded in), k/v [G, N, D]; causal aligns the last M keys with the M queries.
    Returns out [G, M, D] and lse [G, M] (fp32). Score and probability buffers are allocated once."""
    groups, rows, _ = q.shape
    keys = k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(groups, rows)
    scores = torch.empty(groups * block * keys, dtype=q.dtype)
    probs = torch.empty_like(scores)
    bias = torch.full((block, block), float("-inf"), dtype=q.dtype).triu(1)      # [block, block]
    k_t = k.transpose(-1, -2)                                                    # [G, D, N]
    past = keys - rows
    for first in range(0, rows, block):
        last = min(rows, first + block)
        n = past + last if causal else keys                                     # keys these rows may see
        s = scores[: groups * (last - first) * n].view(groups, last - first, n)  # [G, b, n]
        torch.bmm(q[:, first:last], k_t[:, :, :n], out=s)
        if causal:
            s[:, :, past + first: past + last].add_(bias[: last - first, : last - first])
        p = probs[: s.numel()].view_as(s)
        torch.ops.aten._softmax.out(s, -1, False, out=p)
        lse[:, first:last] = s.amax(-1).float() - p.amax(-1).float().log()
        torch.bmm(p, v[:, :n], out=out[:, first:last])
    return out, lse


def run_shape(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, block: int,
              flex: bool, out_path: Path) -> None:
    """q/k/v fp32 [G, M, D] / [G, N, D]; times every kernel on them."""
    scale = q.shape[-1] ** -0.5
    ref_out, ref_lse = FUSED(q[None], k[None], v[None], 0.0, causal, scale=scale)
    ref_out, ref_lse = ref_out[0], ref_lse[0]
    q16, k16, v16 = q.bfloat16(), k.bfloat16(), v.bfloat16()
    kernels = {
        "fused_fp32": lambda: FUSED(q[None], k[None], v[None], 0.0, causal, scale=scale),
        "fused_bf16": lambda: FUSED(q16[None], k16[None], v16[None], 0.0, causal, scale=scale),
        "gemm_bf16": lambda: gemm_attention((q * scale).bfloat16(), k16, v16, causal, block),
    }
    if bf16_kernel.prepare():  # promptcache's own kernel (csrc/flash_bf16.cpp), what `auto` now uses
        kernels["promptcache_bf16"] = lambda: bf16_kernel.loaded()(q16, [k16], [v16], scale, causal)
    compile_s = None
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 1, q.shape[1], k.shape[1], device="cpu") \
            if causal else None
        compiled = torch.compile(flex_attention)
        started = time.perf_counter()
        compiled(q16[None], k16[None], v16[None], block_mask=block_mask, scale=scale)
        compile_s = time.perf_counter() - started
        kernels["flex_bf16"] = lambda: compiled(q16[None], k16[None], v16[None], block_mask=block_mask, scale=scale)
    for kernel, fn in kernels.items():
        ms, _ = median_ms(fn, runs=7)
        result = fn()
        out, lse = result if isinstance(result, (tuple, list)) else (result, None)
        out, lse = (out[0], None if lse is None else lse[0]) if out.dim() == 4 else (out, lse)
        emit({"bench": "attention_bf16", "shape": name, "kernel": kernel, "median_ms": round(ms, 2),
              "max_abs_err_out": round(float((out.float() - ref_out).abs().max()), 5),
              "max_abs_err_lse": None if lse is None else round(float((lse.float() - ref_lse).abs().max()), 5),
              "compile_s": round(compile_s, 1) if kernel == "flex_bf16" else None}, out_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--block", type=int, default=128, help="query rows per GEMM block")
    parser.add_argument("--flex", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "attention_bf16.jsonl")
    args = parser.parse_args()
    setup(args.threads)
    torch.manual_seed(0)
    log("prefill: causal 2,048 x 2,048, 9 heads")
    q, k, v = (torch.randn(9, 2048, 64) for _ in range(3))
    run_shape("prefill_causal_2048_h9", q, k, v, True, args.block, args.flex, args.out)
    log("decode: 224 folded rows x 8,192 shared keys, 2 KV heads")
    q, k, v = torch.randn(2, 224, 64), torch.randn(2, 8192, 64), torch.randn(2, 8192, 64)
    run_shape("decode_shared_8192_rows224_g2", q, k, v, False, 224, args.flex, args.out)


if __name__ == "__main__":
    main()
