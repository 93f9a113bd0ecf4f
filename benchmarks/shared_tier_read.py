"""Reading one module's KV from the shared tiers (Redis, disk): this build against the previous read path.

    git worktree add /tmp/previous <commit before the change>
    python -m benchmarks.shared_tier_read --previous-tree /tmp/previous [--tokens 600 2048] [--rounds 5]

A miss in a replica's device tier is a read from Redis: the index update and the blob, the HMAC check (with
a blob key), the blob's checksum, one copy into tensors. Two builds, each in its own process, alternated
round by round on one redis-server so that both see the same machine state:
- `previous`: the checkout at `--previous-tree` (its RedisTier and DiskTier, imported from there), with
  redis-py's pure-Python reply parser (hiredis hidden: that build did not depend on it);
- `current`: this checkout, with hiredis (the `redis[hiredis]` extra).
Blocks have SmolLM2-135M's KV shape (30 layers, 3 KV heads of 64) in bf16, what `--dtype auto` stores here.
Median ms per read over the rounds' medians; JSON lines under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import RESULTS, emit, log

VARIANTS = ("previous", "current")
CHECKOUT = Path(__file__).resolve().parent.parent
SHAPE = (30, 3, 64)  # layers, KV heads, head dim


def measure(variant: str, url: str, tokens: list[int], reads: int, blob_key: bool) -> dict[str, float]:
    """In a fresh process: median ms of RedisTier.lookup and DiskTier.get per module size."""
    if variant == "previous":
        sys.modules["hiredis"] = None  # redis-py then falls back to its own parser
    import torch

    from promptcache.cache_store import DiskTier, KVBlock, RedisTier
    from promptcache.cache_store.signing import BlobSigner

    signer = BlobSigner(b"k" * 32 if blob_key else None)
    redis_tier = RedisTier(url, max_bytes=1 << 32, namespace=f"read-{variant}-{time.monotonic_ns()}", signer=signer)
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        disk_tier = DiskTier(directory, max_bytes=1 << 32)
        for n in tokens:
            layers, heads, dim = SHAPE
            keys, values = (torch.randn(layers, heads, n, dim).bfloat16() for _ in range(2))
            block, key = KVBlock(keys, values, torch.arange(n)), f"{n:064x}"
            redis_tier.put(key, block)
            disk_tier.put(key, block)
            for tier_name, read in (("redis", redis_tier.lookup), ("disk", disk_tier.get)):
                assert read(key) is not None, f"{tier_name} lost the block"
                times = []
                for _ in range(reads):
                    started = time.perf_counter()
                    read(key)
                    times.append((time.perf_counter() - started) * 1000)
                results[f"{tier_name}/{n}"] = statistics.median(times)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", nargs="+", type=int, default=[600, 2048])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reads", type=int, default=7, help="reads per module, tier and round")
    parser.add_argument("--blob-key", action="store_true", help="sign blobs (HMAC-SHA256), as PROMPTCACHE_BLOB_KEY")
    parser.add_argument("--previous-tree", type=Path, required=True, help="a checkout of the build to compare with")
    parser.add_argument("--out", type=Path, default=RESULTS / "shared_tier_read.jsonl")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "URL"), help=argparse.SUPPRESS)
    args = parser.parse_args(["--previous-tree", "-", *sys.argv[1:]] if "--child" in sys.argv else None)
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], args.tokens, args.reads, args.blob_key)))
        return
    from benchmarks.store import start_redis

    rounds: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as directory:
        redis_process, url = start_redis(directory)
        try:
            for round_index in range(args.rounds):
                for variant in VARIANTS:
                    command = [sys.executable, __file__, "--child", variant, url, "--tokens", *map(str, args.tokens),
                               "--reads", str(args.reads), *(["--blob-key"] if args.blob_key else [])]
                    tree = args.previous_tree if variant == "previous" else CHECKOUT
                    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
                    output = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
                    rounds[variant].append(json.loads(output.strip().splitlines()[-1]))
                log(f"round {round_index + 1}/{args.rounds}")
        finally:
            redis_process.kill()
    for name in rounds["current"][0]:
        tier, n = name.split("/")
        medians = {v: round(statistics.median(r[name] for r in rounds[v]), 2) for v in VARIANTS}
        emit({"bench": "shared_tier_read", "tier": tier, "tokens": int(n), "dtype": "bfloat16",
              "mbytes": round(2 * SHAPE[0] * SHAPE[1] * SHAPE[2] * int(n) * 2 / 1e6, 1), "blob_key": args.blob_key,
              **{f"{v}_ms": medians[v] for v in VARIANTS},
              "speedup": round(medians["previous"] / medians["current"], 2), "rounds": args.rounds,
              "previous_commit": _commit(args.previous_tree)}, args.out)


def _commit(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


if __name__ == "__main__":
    main()
