"""Engine decode steps on a GPU, B sequences sharing a module set: shared-module attention vs per-sequence
SDPA vs the no-attention ceiling, and one profiled step of the shared mode.

    python -m benchmarks.engine.gpu_decode --device cuda              # ~1B Llama shape, bf16, B = 32 x 8K shared
    python -m benchmarks.engine.gpu_decode --device cpu --smoke       # tiny, to check the script

decode.py's modes (`run_mode`) on the TinyLlama-1.1B shape with random weights made on the device, its
decoder layers fused as the server loads them (loading/fused_layers.py):
baseline_sdpa (each sequence's KV in one [B, H_kv, P + S, D] buffer, torch SDPA with native GQA), shared
(promptcache's engine step: ModelRunner and shared-module attention), noattention (attention output :=
query). One more step of the shared mode runs under torch.profiler: its kernel count and the ops that
took the most device time are one more JSON line.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks.engine.decode import pooled_sequences, register_modes, run_mode
from benchmarks.harness import device_name, emit, gpu_parser, log
from benchmarks.shapes import SHAPES, byte_tokenizer
from promptcache.cache_store import KVBlock
from promptcache.model_runtime.engine.prefix import KVView
from promptcache.model_runtime.engine.request import SharedKV
from promptcache.model_runtime.engine.runner import ModelRunner
from promptcache.model_runtime.engine.step_plan import ScheduledSeq
from promptcache.model_runtime.loading.loader import wrap_model
from promptcache.model_runtime.packed_attention import install

MODES = ("baseline_sdpa", "shared", "noattention")


def build(device: torch.device, dtype: torch.dtype, smoke: bool):
    tokenizer = byte_tokenizer()
    config = (LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16384)
              if smoke else SHAPES["tinyllama-1.1b"](32000))
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    loaded = wrap_model(model, tokenizer, name="tiny-llama" if smoke else "tinyllama-1.1b", fuse_layers=True)
    install(model)
    return model, loaded


def profile_step(loaded, batch: int, shared: int, own: int, top: int = 15) -> dict:
    """One shared-mode engine step (after a warm-up step) under torch.profiler."""
    device, dtype = loaded.model.device, loaded.model.dtype
    shape = (loaded.num_layers, loaded.num_kv_heads, shared, loaded.head_dim)
    block = KVBlock(torch.full(shape, 0.01, dtype=dtype, device=device),
                    torch.full(shape, 0.01, dtype=dtype, device=device), torch.arange(shared))
    seqs = pooled_sequences(loaded, [[SharedKV(KVView("modules"), block)] for _ in range(batch)], own + 2, own)
    runner = ModelRunner(loaded)

    def step() -> None:
        for seq in seqs:
            seq.pending_ids, seq.pending_positions = [7], [shared + seq.own_length]
        runner.forward([ScheduledSeq(seq, 1) for seq in seqs])
        for seq in seqs:
            seq.advance(1)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.inference_mode():
        step()
        with profile(activities=activities) as prof:
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    events = prof.key_averages()

    def device_us(event) -> float:
        return getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0))

    kernels = [e for e in events if device_us(e) > 0 and "DeviceType.CUDA" in str(getattr(e, "device_type", ""))]
    ranked = sorted(events, key=device_us if device.type == "cuda" else (lambda e: e.self_cpu_time_total),
                    reverse=True)[:top]
    return {"bench": "gpu_decode_profile", "batch": batch, "shared_tokens": shared, "own_tokens": own,
            "kernel_launches": sum(e.count for e in kernels),
            "device_ms": round(sum(device_us(e) for e in kernels) / 1e3, 3),
            "top": [{"op": e.key[:80], "count": e.count, "device_us": round(device_us(e), 1),
                     "cpu_us": round(e.self_cpu_time_total, 1)} for e in ranked]}


def main() -> None:
    parser = gpu_parser(__doc__, "decode.jsonl", "a tiny model and batch (checks the script)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--shared", type=int, default=8192)
    parser.add_argument("--own", type=int, default=256)
    parser.add_argument("--steps", type=int, default=11, help="decode steps per mode (the first is a warm-up)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.shared, args.own, args.steps = 4, 512, 16, 3
    device = torch.device(args.device)
    register_modes()
    model, loaded = build(device, getattr(torch, args.dtype), args.smoke)
    name = device_name(device)
    by_mode = {}
    for mode in args.modes:
        record = run_mode(mode, model, loaded, args.batch, args.shared, args.own, args.steps)
        record.pop("peak_rss_mb", None)
        if device.type == "cuda":
            record["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        emit({"bench": "gpu_decode", "shape": loaded.name, "device": name, **record}, args.out)
        by_mode[mode] = record["ms_per_step"]
    emit({**profile_step(loaded, args.batch, args.shared, args.own), "device": name}, args.out)
    if "shared" in by_mode and "baseline_sdpa" in by_mode:
        log(f"decode step: shared {by_mode['shared']} ms, per-sequence SDPA {by_mode['baseline_sdpa']} ms "
            f"({by_mode['baseline_sdpa'] / by_mode['shared']:.2f}x)")


if __name__ == "__main__":
    main()
