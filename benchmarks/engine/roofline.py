"""How close the engine's prefill and decode come to this machine's measured peaks (FLOP/s, memory bandwidth).

    python -m benchmarks.engine.roofline

Peaks are measured here, in this run (never taken from a spec sheet): GEMM in the model's dtype (2048^3,
the thread count below) for FLOP/s, and a 512 MiB tensor copy (bytes read + written) for bandwidth. Then the
real default model (SmolLM2-135M-Instruct, `--dtype`, weights packed as the server packs them) through the engine's
ModelRunner: a 2,048-token prefill (FLOPs counted
from the weights: 2 x every Linear's weights per token, plus causal attention 2 x 2 x layers x heads x
head_dim x T^2 / 2) and decode steps at batch 1 and 32 with 512 own tokens each (bytes: every Linear
weight read once per step, plus each sequence's KV). Achieved / peak is the figure of merit.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, emit, log, median_ms, setup
from promptcache.model_runtime import ModelConfig, load_model
from promptcache.model_runtime.engine.request import SeqStatus, Sequence
from promptcache.model_runtime.engine.runner import ModelRunner
from promptcache.model_runtime.engine.step_plan import ScheduledSeq
from promptcache.model_runtime.loading.packed_linear import PackedLinear


def peak_flops(dtype: torch.dtype) -> float:
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    ms, _ = median_ms(lambda: a @ b, runs=5)
    return 2 * 2048**3 / (ms / 1e3)


def peak_bandwidth() -> float:
    src, dst = torch.ones(128 << 20), torch.empty(128 << 20)  # 512 MiB each (fp32)
    ms, _ = median_ms(lambda: dst.copy_(src), runs=5)
    return 2 * src.numel() * 4 / (ms / 1e3)


def linear_params(model) -> int:
    """Weights of every linear layer the forward pass multiplies by (plain or packed), the lm_head apart
    (counted for one row per sequence)."""
    return sum(m.in_features * m.out_features for name, m in model.named_modules()
               if isinstance(m, (torch.nn.Linear, PackedLinear)) and not name.endswith("lm_head"))


def new_sequence(loaded, capacity: int, own: int = 0) -> Sequence:
    shape = (loaded.num_layers, loaded.num_kv_heads, capacity, loaded.head_dim)
    dtype = loaded.model.dtype
    seq = Sequence(seq_id=0, request=None, index=0, shared=[],  # type: ignore[arg-type]
                   own_keys=torch.zeros(shape, dtype=dtype), own_values=torch.zeros(shape, dtype=dtype))
    seq.own_length = own
    return seq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--own", type=int, default=512)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="of the model and of the GEMM peak (auto: what `promptcache serve` picks here)")
    parser.add_argument("--out", type=Path, default=RESULTS / "roofline.jsonl")
    args = parser.parse_args()
    setup(args.threads)
    config = ModelConfig(dtype=args.dtype)  # weights packed as the server packs them
    dtype = config.torch_dtype
    flops_peak, bytes_peak = peak_flops(dtype), peak_bandwidth()
    label = {"dtype": str(dtype).removeprefix("torch.")}
    emit({"bench": "roofline_peak", **label, "gemm_gflops": round(flops_peak / 1e9, 1),
          "copy_gb_per_s": round(bytes_peak / 1e9, 2)}, args.out)
    loaded = load_model(config)
    runner = ModelRunner(loaded)
    weights = linear_params(loaded.model)
    head = loaded.model.get_output_embeddings()
    vocab_row = head.in_features * head.out_features
    bytes_per_value = torch.empty((), dtype=dtype).element_size()
    heads = loaded.model.config.num_attention_heads

    t = args.prefill
    def prefill() -> None:
        seq = new_sequence(loaded, t + 1)
        seq.status = SeqStatus.PREFILL
        seq.pending_ids, seq.pending_positions = [i % 1000 + 10 for i in range(t)], list(range(t))
        runner.forward([ScheduledSeq(seq, t)])

    ms, _ = median_ms(prefill, runs=3)
    flops = 2 * t * weights + 2 * vocab_row + 2 * 2 * loaded.num_layers * heads * loaded.head_dim * t * t / 2
    emit({"bench": "roofline_prefill", **label, "tokens": t, "ms": round(ms, 1), "gflop": round(flops / 1e9, 2),
          "gflops": round(flops / ms / 1e6, 1), "of_peak": round(flops / (ms / 1e3) / flops_peak, 3)}, args.out)

    for batch in (1, 32):
        seqs = [new_sequence(loaded, args.own + 8, args.own) for _ in range(batch)]

        def step(seqs=seqs) -> None:
            for seq in seqs:
                seq.status = SeqStatus.DECODE
                seq.pending_ids, seq.pending_positions = [42], [seq.own_length]
            runner.forward([ScheduledSeq(seq, 1) for seq in seqs])
            for seq in seqs:
                seq.advance(1)

        with torch.inference_mode():
            step()
            started, steps = time.perf_counter(), 5
            for _ in range(steps):
                step()
            ms = (time.perf_counter() - started) / steps * 1e3
        kv = batch * (args.own + 3) * loaded.kv_bytes_per_token
        moved = (weights + vocab_row) * bytes_per_value + kv
        emit({"bench": "roofline_decode", **label, "batch": batch, "own_tokens": args.own, "ms_per_step": round(ms, 2),
              "gb_read": round(moved / 1e9, 3), "gb_per_s": round(moved / ms / 1e6, 2),
              "of_peak_bandwidth": round(moved / (ms / 1e3) / bytes_peak, 3),
              "gflops": round((2 * batch * (weights + vocab_row)) / ms / 1e6, 1)}, args.out)
    log("done")


if __name__ == "__main__":
    main()
