"""What a sliding-window model's cached KV costs to fetch from a shared tier, whole and in part (only the keys its
local layers still reach), Gemma 3 270M's shape (18 layers, 1 KV head of 256, bf16; 15 local layers, window 512).

    python -m benchmarks.engine.window_fetch --tokens 2048 8192

A module: the part is what a request reads whose question follows it (its first query at the module's end): every
token on the 3 global layers, the last 511 (rounded down to a 64-token chunk) on the local ones. A prefix chain: the
same tokens as 32-token prefix blocks, matched by a request that adds 20 tokens (`BlockIndex.match`, with the model's
windows and without). Starts its own redis-server on a free loopback port; bytes are those the tier read
(`bytes_read`), times are medians.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, emit, log, median_ms, setup
from benchmarks.live_server import RedisServer
from promptcache.cache_store import (
    BlobSigner,
    BlockIndex,
    BlockIndexConfig,
    DiskTier,
    KVBlock,
    RedisTier,
    TieredStore,
    window_reach,
)

LAYERS, KV_HEADS, HEAD_DIM, WINDOW = 18, 1, 256, 512
WINDOWS = tuple(None if (layer + 1) % 6 == 0 else WINDOW for layer in range(LAYERS))  # Gemma 3's 5 local : 1 global


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "window_fetch.jsonl")
    args = parser.parse_args()
    setup(args.threads)
    workdir = tempfile.mkdtemp(prefix="promptcache-window-fetch-")
    server = RedisServer(workdir)
    server.start()
    try:
        tiers = {"redis": RedisTier(server.url, max_bytes=8 << 30, namespace="plain", timeout_s=30),
                 "redis signed": RedisTier(server.url, max_bytes=8 << 30, namespace="signed", timeout_s=30,
                                           signer=BlobSigner(b"k" * 32)),
                 "disk": DiskTier(Path(workdir) / "disk", max_bytes=8 << 30)}
        for n in args.tokens:
            g = torch.Generator().manual_seed(n)
            block = KVBlock(torch.randn(LAYERS, KV_HEADS, n, HEAD_DIM, generator=g).bfloat16(),
                            torch.randn(LAYERS, KV_HEADS, n, HEAD_DIM, generator=g).bfloat16(), torch.arange(n))
            reach = window_reach(WINDOWS, range(n), first_query=n)
            for name, tier in tiers.items():
                key = f"m{n}"
                tier.put(key, block)
                row = {}
                for read, wanted in (("whole", None), ("part", reach)):
                    before = tier.bytes_read
                    hit = tier.lookup(key, wanted)
                    assert hit is not None and (hit.block.present is None) == (wanted is None)
                    row[read] = (tier.bytes_read - before,
                                 median_ms(lambda t=tier, k=key, w=wanted: t.lookup(k, w), runs=args.runs)[0])
                emit({"bench": "window_fetch", "shape": "gemma3-270m", "module_tokens": n, "tier": name,
                      "whole_bytes": row["whole"][0], "part_bytes": row["part"][0],
                      "part_fraction": round(row["part"][0] / row["whole"][0], 4),
                      "whole_ms": round(row["whole"][1], 3), "part_ms": round(row["part"][1], 3)}, args.out)
                log(f"{n} tokens, {name}: whole {row['whole'][0] / 2**20:.1f} MiB {row['whole'][1]:.2f} ms, "
                    f"part {row['part'][0] / 2**20:.1f} MiB {row['part'][1]:.2f} ms")
            prefix_chain(block, tiers["redis"], args)
    finally:
        server.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def prefix_chain(block: KVBlock, redis: RedisTier, args: argparse.Namespace) -> None:
    """`block`'s tokens as a chain of 32-token prefix blocks in `redis`, matched whole and in part."""
    n, store = block.num_tokens, TieredStore([redis])
    ids, positions = list(range(1000, 1000 + n + 20)), list(range(n + 20))

    def index(windows: tuple[int | None, ...]) -> BlockIndex:
        return BlockIndex(store, BlockIndexConfig(block_size=32), model_fingerprint="bench", tokenizer_fingerprint="b",
                          bytes_per_token=block.nbytes // n, windows=windows)

    index(()).insert("root", ids[:n], positions[:n], lambda a, b: (block.keys[:, :, a:b], block.values[:, :, a:b]),
                     salt=None)
    store.flush()
    row = {}
    for read, windows in (("whole", ()), ("part", WINDOWS)):
        matcher = index(windows)
        before = redis.bytes_read
        assert matcher.match("root", ids, positions, salt=None, max_tokens=n + 19).num_tokens == n
        row[read] = (redis.bytes_read - before, median_ms(
            lambda m=matcher: m.match("root", ids, positions, salt=None, max_tokens=n + 19), runs=args.runs)[0])
    emit({"bench": "window_fetch", "shape": "gemma3-270m", "module_tokens": n, "tier": "redis prefix blocks",
          "whole_bytes": row["whole"][0], "part_bytes": row["part"][0],
          "part_fraction": round(row["part"][0] / row["whole"][0], 4),
          "whole_ms": round(row["whole"][1], 3), "part_ms": round(row["part"][1], 3)}, args.out)
    log(f"{n} tokens as prefix blocks, redis: whole {row['whole'][0] / 2**20:.1f} MiB {row['whole'][1]:.2f} ms, "
        f"part {row['part'][0] / 2**20:.1f} MiB {row['part'][1]:.2f} ms")


if __name__ == "__main__":
    main()
