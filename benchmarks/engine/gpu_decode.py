"""Engine decode steps on a GPU, B sequences sharing a module set: shared-module attention vs per-sequence
SDPA vs the no-attention ceiling, and one profiled step of the shared mode.

    python -m benchmarks.engine.gpu_decode --device cuda              # ~1B Llama shape, bf16, B = 32 x 8K shared
    python -m benchmarks.engine.gpu_decode --device cpu --smoke       # tiny, to check the script

decode.py's modes (`run_mode`) on the TinyLlama-1.1B shape with random weights made on the device, its
decoder layers fused as the server loads them (loading/fused_layers.py):
baseline_sdpa (each sequence's KV in one [B, H_kv, P + S, D] buffer, torch SDPA with native GQA), shared
(promptcache's engine step: ModelRunner and shared-module attention, eager), noattention (attention output :=
query). Each also replayed from a CUDA graph, so the step ratio compares graph with graph: shared_graph (the
engine's own graphed step, engine/cuda_graphs.py: buffers filled, one copy, replay, logits copied out),
baseline_sdpa_graph and noattention_graph (graph_baselines.py: the same static forward, attention swapped). One
more step of the shared mode, eager and graphed, runs under torch.profiler: device kernels, host launch calls
(kernel launches, graph launches, copies) and the ops that took the most device time are one more JSON line each.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks.engine.decode import pooled_sequences, register_modes, run_mode
from benchmarks.engine.graph_baselines import run_graphed
from benchmarks.harness import device_name, emit, gpu_parser, log
from benchmarks.shapes import SHAPES, byte_tokenizer
from promptcache.cache_store import KVBlock
from promptcache.model_runtime.engine.prefix import KVView
from promptcache.model_runtime.engine.request import SharedKV
from promptcache.model_runtime.engine.runner import ModelRunner
from promptcache.model_runtime.engine.step_plan import ScheduledSeq
from promptcache.model_runtime.loading import torch_layer_ops
from promptcache.model_runtime.loading.fused_layers import fuse_layers
from promptcache.model_runtime.loading.loader import wrap_model
from promptcache.model_runtime.packed_attention import install

MODES = ("baseline_sdpa", "shared", "noattention", "baseline_sdpa_graph", "shared_graph", "noattention_graph")
# Host calls that start work on the GPU: one graph launch stands for all the kernels it holds.
HOST_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch",
                 "cudaMemcpyAsync", "cudaMemsetAsync")


def build(device: torch.device, dtype: torch.dtype, smoke: bool):
    tokenizer = byte_tokenizer()
    config = (LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16384)
              if smoke else SHAPES["tinyllama-1.1b"](32000))
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    if device.type == "cpu":  # the GPU's fused layers (torch's ops), so the smoke run takes the static forward too
        fuse_layers(model, torch_layer_ops)
    loaded = wrap_model(model, tokenizer, name="tiny-llama" if smoke else "tinyllama-1.1b", fuse_layers=True)
    install(model)
    return model, loaded


def profile_step(loaded, batch: int, shared: int, own: int, top: int = 15, *, cuda_graphs: bool = False) -> dict:
    """One shared-mode engine step (after two warm-up steps: with `cuda_graphs`, the second captures) under
    torch.profiler: device kernels, host launch calls and the top ops."""
    device, dtype = loaded.model.device, loaded.model.dtype
    shape = (loaded.num_layers, loaded.num_kv_heads, shared, loaded.head_dim)
    block = KVBlock(torch.full(shape, 0.01, dtype=dtype, device=device),
                    torch.full(shape, 0.01, dtype=dtype, device=device), torch.arange(shared))
    seqs = pooled_sequences(loaded, [[SharedKV(KVView("modules"), block)] for _ in range(batch)], own + 3, own)
    runner = ModelRunner(loaded, cuda_graphs=cuda_graphs)

    def step() -> None:
        for seq in seqs:
            seq.pending_ids, seq.pending_positions = [7], [shared + seq.own_length]
        runner.forward([ScheduledSeq(seq, 1) for seq in seqs])
        for seq in seqs:
            seq.advance(1)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.inference_mode():
        step()
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
            "graphed": runner.graphs is not None and bool(runner.graphs.graphs),
            "kernel_launches": sum(e.count for e in kernels),
            "host_launches": sum(e.count for e in events if e.key in HOST_LAUNCHES),
            "host_launch_calls": {e.key: e.count for e in events if e.key in HOST_LAUNCHES},
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
        if mode in ("baseline_sdpa_graph", "noattention_graph"):
            record = run_graphed(mode.removesuffix("_graph"), model, args.batch, args.shared, args.own, args.steps)
            if record is None:
                log(f"{mode}: the model has no static forward (unfused layers); skipped")
                continue
        else:
            graphed = mode == "shared_graph"
            record = run_mode(mode.removesuffix("_graph"), model, loaded, args.batch, args.shared, args.own,
                              args.steps, cuda_graphs=graphed, warmup=2 if graphed else 1)
            record["mode"] = mode
        record.pop("peak_rss_mb", None)
        if device.type == "cuda":
            record["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        emit({"bench": "gpu_decode", "shape": loaded.name, "device": name, **record}, args.out)
        by_mode[mode] = record["ms_per_step"]
    for graphs in (False, True):
        emit({**profile_step(loaded, args.batch, args.shared, args.own, cuda_graphs=graphs), "mode":
              "shared_graph" if graphs else "shared", "device": name}, args.out)
    for suffix in ("", "_graph"):
        shared, sdpa = by_mode.get("shared" + suffix), by_mode.get("baseline_sdpa" + suffix)
        if shared and sdpa:
            log(f"decode step{suffix}: shared {shared} ms, per-sequence SDPA {sdpa} ms ({sdpa / shared:.2f}x)")


if __name__ == "__main__":
    main()
