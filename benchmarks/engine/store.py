"""Fetching a module's KV from each tier vs recomputing it (prefill), Qwen2.5-0.5B shape, fp32.

    python -m benchmarks.engine.store --tokens 256 1024 4096

Starts its own redis-server on a free loopback port. Tiers: device (in-process, referenced), host
(in-process + a copy into the request buffer, as assembly does), redis (GET + verify + deserialize),
disk (read + verify + deserialize). Recompute = encoding the module with the model (what a miss costs).
The store's FetchPolicy makes the same comparison online to skip a tier that would be slower.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, emit, log, median_ms, setup
from benchmarks.live_server import RedisServer
from benchmarks.shapes import build_model
from promptcache.cache_store import DiskTier, KVBlock, MemoryTier, RedisTier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", nargs="+", type=int, default=[256, 1024, 4096])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "store.jsonl")
    args = parser.parse_args()
    setup(args.threads)
    model = build_model("qwen2.5-0.5b")
    config = model.config
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = config.hidden_size // config.num_attention_heads
    workdir = tempfile.mkdtemp(prefix="promptcache-store-bench-")
    server = RedisServer(workdir)
    server.start()
    url = server.url
    try:
        tiers = {"device": MemoryTier("device", 8 << 30), "host": MemoryTier("host", 8 << 30),
                 "redis": RedisTier(url, max_bytes=8 << 30, namespace="bench", timeout_s=30),
                 "disk": DiskTier(Path(workdir) / "disk", max_bytes=8 << 30)}
        for n in args.tokens:
            g = torch.Generator().manual_seed(n)
            block = KVBlock(torch.randn(layers, kv_heads, n, head_dim, generator=g),
                            torch.randn(layers, kv_heads, n, head_dim, generator=g), torch.arange(n))
            key = f"m{n}"
            for tier in tiers.values():
                tier.put(key, block)
            results = {
                "device": median_ms(lambda key=key: tiers["device"].get(key), runs=args.runs)[0],
                "host": median_ms(lambda key=key: tiers["host"].get(key).keys.clone(), runs=args.runs)[0],
                "redis": median_ms(lambda key=key: tiers["redis"].get(key), runs=args.runs)[0],
                "disk": median_ms(lambda key=key: tiers["disk"].get(key), runs=args.runs)[0],
            }
            ids, positions = torch.randint(0, 1000, (n,)).tolist(), list(range(n))

            def recompute(ids=ids, positions=positions) -> None:  # a prefill of the module's tokens, KV kept
                with torch.inference_mode():
                    model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]), use_cache=True)

            results["recompute"] = median_ms(recompute, runs=max(3, args.runs // 2))[0]
            for tier, ms in results.items():
                emit({"bench": "store", "shape": "qwen2.5-0.5b", "module_tokens": n,
                      "block_mb": round(block.nbytes / 2**20, 1), "source": tier, "median_ms": round(ms, 3),
                      "speedup_vs_recompute": round(results["recompute"] / ms, 1) if ms else None}, args.out)
            log(f"{n} tokens: " + ", ".join(f"{k} {v:.2f} ms" for k, v in results.items()))
    finally:
        server.kill()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
