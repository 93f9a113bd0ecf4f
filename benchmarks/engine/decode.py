"""Decode throughput with a shared module set: per-sequence KV vs shared-module attention.

    python -m benchmarks.engine.decode --batches 1 4 16 32 64 --shared 512 2048 8192

Qwen2.5-0.5B shape, random weights, `--dtype` as the server picks it (auto), linear weights packed as
the server packs them, 2 threads. Every sequence attends to `shared` tokens of
module KV that all sequences of the batch import, plus its own `own` tokens. Modes, side by side:
- baseline_hf: the model's default attention (SDPA) with a DynamicCache holding each sequence's
  full KV (the shared part copied per sequence), as HF generate would;
- baseline_sdpa: per-sequence KV in one preallocated buffer, torch SDPA with native GQA;
- shared: promptcache's engine step (ModelRunner + shared-module attention): the shared KV once,
  attended by all queries of the batch in one matrix-matrix call, merged with each sequence's own KV
  (slots of one KVPool, as the engine keeps it);
- noattention: attention output := query (the ceiling: everything but attention, as in Hydragen).
KV is filled with constant values instead of a prefill (timing does not depend on values); tokens/s =
batch x steps / decode time. Peak RSS is sampled per run. Also reports how many sequences sharing an
8K-token module set fit a fixed KV budget, per-sequence vs shared (the engine's own accounting).
"""

from __future__ import annotations

import argparse
import functools
import gc
import resource
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from benchmarks.harness import RESULTS, emit, log, setup
from benchmarks.shapes import build_model
from promptcache.cache_store import KVBlock
from promptcache.model_runtime.engine.memory import KVMemory
from promptcache.model_runtime.engine.prefix import KVView
from promptcache.model_runtime.engine.request import Sequence, SharedKV
from promptcache.model_runtime.engine.runner import ModelRunner
from promptcache.model_runtime.engine.step_plan import ScheduledSeq
from promptcache.model_runtime.kv_pool import KVPool
from promptcache.model_runtime.loading.default_model import default_model_path
from promptcache.model_runtime.loading.loader import ModelConfig, wrap_model
from promptcache.model_runtime.packed_attention import install

MODES = ("baseline_hf", "baseline_sdpa", "shared", "noattention")


def _no_attention(module, query, key, value, attention_mask, **kwargs):
    return query.transpose(1, 2), None  # [B, H, Q, D] -> [B, Q, H, D]: output := query


class _PerSequenceBuffer(DynamicCache):
    """[B, H_kv, capacity, D] per layer, appended in place; attention by SDPA with native GQA."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int) -> None:
        super().__init__()
        self.k, self.v, self.length = keys, values, length

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        n = key_states.shape[2]
        self.k[layer_idx][:, :, self.length: self.length + n] = key_states
        self.v[layer_idx][:, :, self.length: self.length + n] = value_states
        out = self.k[layer_idx][:, :, : self.length + n], self.v[layer_idx][:, :, : self.length + n]
        if layer_idx == len(self.k) - 1:
            self.length += n
        return out

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.length + query_length, 0


def _sdpa_gqa(module, query, key, value, attention_mask, scaling=None, **kwargs):
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2), None


def _kv(*shape: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    # cheap to fill even at several GB; values do not change the timing
    return torch.full(shape, 0.01, dtype=dtype, device=device)


def pooled_sequences(loaded, shared: list[list[SharedKV]], capacity: int, own: int) -> list[Sequence]:
    """One sequence per entry of `shared` (the blocks it imports), its own KV `capacity` slots of one
    KVPool as the engine keeps it, the first `own` of them filled with constant values."""
    model = loaded.model
    pool = KVPool(num_layers=loaded.num_layers, num_kv_heads=loaded.num_kv_heads, head_dim=loaded.head_dim,
                  num_slots=len(shared) * capacity, dtype=model.dtype, device=model.device)
    pool.keys.fill_(0.01)
    pool.values.fill_(0.01)
    seqs = []
    for i, blocks in enumerate(shared):
        first = pool.allocate(capacity)
        keys, values = pool.slots(first, capacity)
        seq = Sequence(seq_id=i, request=None, index=0, shared=blocks, own_keys=keys,  # type: ignore[arg-type]
                       own_values=values, own_pool=pool, own_slot=first)
        seq.own_length = own
        seqs.append(seq)
    return seqs


def register_modes() -> None:
    """The baseline and ceiling attention functions `run_mode` switches the model to."""
    AttentionInterface.register("bench_baseline_sdpa", _sdpa_gqa)
    AttentionInterface.register("bench_noattention", _no_attention)
    for name in ("bench_baseline_sdpa", "bench_noattention"):
        AttentionMaskInterface.register(name, sdpa_mask)


def model_args(parser: argparse.ArgumentParser) -> None:
    """--dtype, --no-weight-packing and --no-layer-fusion, as `promptcache serve` takes them."""
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="auto: what `promptcache serve` picks on this machine")
    parser.add_argument("--no-weight-packing", action="store_true", help="plain nn.Linear (the server packs)")
    parser.add_argument("--no-layer-fusion", action="store_true", help="HF's decoder modules (the server fuses "
                        "them in bf16 where the CPU has AVX512-BF16)")


def load_shape(args: argparse.Namespace):
    """The Qwen2.5-0.5B shape in the server's dtype and layout, wrapped as the runtime wraps models."""
    dtype = ModelConfig(dtype=args.dtype).torch_dtype
    model = build_model("qwen2.5-0.5b", dtype=dtype)
    loaded = wrap_model(model, AutoTokenizer.from_pretrained(default_model_path()), name="qwen2.5-0.5b",
                        pack_weights=not args.no_weight_packing, fuse_layers=not args.no_layer_fusion)
    install(model)
    return model, loaded


def run_mode(mode: str, model, loaded, batch: int, shared: int, own: int, steps: int, *, cuda_graphs: bool = True,
             warmup: int = 1) -> dict:
    """Time `steps - warmup` decode steps (after `warmup` untimed ones) of `mode` on the model's device; `cuda_graphs`:
    the shared mode's runner replays uniform steps from graphs where it can (a GPU: warm up 2, the second captures)."""
    layers, kv_heads, head_dim, dtype = loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, model.dtype
    device = model.device
    kv = functools.partial(_kv, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (batch, steps), generator=g)
    if mode == "shared":
        block = KVBlock(kv(layers, kv_heads, shared, head_dim), kv(layers, kv_heads, shared, head_dim),
                        torch.arange(shared))
        runner = ModelRunner(loaded, cuda_graphs=cuda_graphs)
        seqs = pooled_sequences(loaded, [[SharedKV(KVView("modules"), block)] for _ in range(batch)], own + steps, own)

        def step(t: int) -> None:
            for i, seq in enumerate(seqs):
                seq.pending_ids, seq.pending_positions = [int(tokens[i, t])], [shared + own + t]
            runner.forward([ScheduledSeq(seq, 1) for seq in seqs])
            for seq in seqs:
                seq.advance(1)
    else:
        total = shared + own
        model.set_attn_implementation("sdpa" if mode == "baseline_hf" else f"bench_{mode}")
        if mode == "baseline_hf":
            cache = DynamicCache()
            for layer in range(layers):  # each sequence holds its own copy of the shared KV
                cache.update(kv(batch, kv_heads, total, head_dim), kv(batch, kv_heads, total, head_dim), layer)
        elif mode == "baseline_sdpa":
            keys = [kv(batch, kv_heads, total + steps, head_dim) for _ in range(layers)]
            values = [kv(batch, kv_heads, total + steps, head_dim) for _ in range(layers)]
            cache = _PerSequenceBuffer(keys, values, total)
        else:
            cache = None

        def step(t: int) -> None:
            nonlocal cache
            ids = tokens[:, t: t + 1].to(device)                       # [B, 1]
            positions = torch.full((batch, 1), total + t, device=device)  # [B, 1]
            out = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=cache is not None,
                        logits_to_keep=1)
            if mode == "baseline_hf":
                cache = out.past_key_values

    with torch.inference_mode():
        for t in range(warmup):  # not timed
            step(t)
        _synchronize(device)
        started = time.perf_counter()
        for t in range(warmup, steps):
            step(t)
        _synchronize(device)
        elapsed = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model.set_attn_implementation("promptcache_shared")
    return {"mode": mode, "batch": batch, "shared_tokens": shared, "own_tokens": own,
            "dtype": str(dtype).removeprefix("torch."),
            "packed": any(type(m).__name__ == "PackedLinear" for m in model.modules()),
            "tokens_per_s": round(batch * (steps - warmup) / elapsed, 2),
            "ms_per_step": round(elapsed / (steps - warmup) * 1e3, 2),
            "peak_rss_mb": round(peak_mb, 1)}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def capacity(loaded, shared: int, own: int, budget_bytes: int) -> dict:
    """Sequences admitted under `budget_bytes` by the engine's KV accounting, per-sequence vs shared."""
    bytes_per_token = loaded.kv_bytes_per_token
    counts = {}
    for mode in ("per_sequence", "shared"):
        memory, n = KVMemory(budget_bytes), 0
        while True:
            key = "modules" if mode == "shared" else f"modules-{n}"
            blocks, own_bytes = {key: shared * bytes_per_token}, own * bytes_per_token
            if not memory.fits(own_bytes, blocks):
                break
            memory.reserve(own_bytes, blocks)
            n += 1
        counts[mode] = n
    return {"bench": "decode_capacity", "shared_tokens": shared, "own_tokens": own, "budget_gb": budget_bytes / 2**30,
            "per_sequence": counts["per_sequence"], "shared": counts["shared"],
            "ratio": round(counts["shared"] / max(counts["per_sequence"], 1), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 32, 64])
    parser.add_argument("--shared", nargs="+", type=int, default=[512, 2048, 8192])
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--own", type=int, default=64, help="per-sequence tokens (new text + generated so far)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--budget-gb", type=float, default=8.0)
    parser.add_argument("--max-baseline-gb", type=float, default=14.0, help="skip per-sequence runs needing more KV")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "decode.jsonl")
    model_args(parser)
    args = parser.parse_args()
    setup(args.threads)
    register_modes()
    model, loaded = load_shape(args)
    bytes_per_token = loaded.kv_bytes_per_token
    records = []
    for shared in args.shared:
        for batch in args.batches:
            row = {}
            for mode in args.modes:
                baseline_bytes = batch * (shared + args.own) * bytes_per_token
                if mode.startswith("baseline") and baseline_bytes > args.max_baseline_gb * 2**30:
                    continue
                gc.collect()
                record = run_mode(mode, model, loaded, batch, shared, args.own, args.steps)
                row[mode] = record["tokens_per_s"]
                emit({"bench": "decode", "shape": "qwen2.5-0.5b", **record}, args.out)
                records.append(record)
            if "shared" in row and "baseline_sdpa" in row:
                ratio = f"shared/baseline_sdpa = {row['shared'] / row['baseline_sdpa']:.2f}x"
                if "noattention" in row:
                    ratio += f", shared/noattention = {row['shared'] / row['noattention']:.2f}"
                log(f"batch {batch} shared {shared}: {ratio}")
    emit(capacity(loaded, 8192, 256, int(args.budget_gb * 2**30)), args.out)
    plot(records, args.out.with_suffix(".png"), str(model.dtype).removeprefix("torch."))


def plot(records: list[dict], path: Path, dtype: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shareds = sorted({r["shared_tokens"] for r in records})
    fig, axes = plt.subplots(1, len(shareds), figsize=(4.2 * len(shareds), 3.6), squeeze=False)
    for ax, shared in zip(axes[0], shareds):
        for mode in MODES:
            rows = sorted((r for r in records if r["shared_tokens"] == shared and r["mode"] == mode),
                          key=lambda r: r["batch"])
            if rows:
                ax.plot([r["batch"] for r in rows], [r["tokens_per_s"] for r in rows], "o-", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_title(f"shared {shared} tokens")
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tokens/s")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Decode throughput, Qwen2.5-0.5B shape, CPU {dtype}, 2 threads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
