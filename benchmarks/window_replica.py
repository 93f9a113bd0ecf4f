"""A fresh replica's first question on a document module it finds in Redis, over HTTP, one build beside another:
with a sliding-window model the build that reads a module in part (only what its local layers still reach) against
one that reads it whole.

    python -m benchmarks.window_replica --builds before=/tmp/wt_old after=. [--model gemma3-270m]

Per build, in turn: its own redis-server on a free loopback port; `promptcache encode` writes a schema of
`--documents` modules of ~2K tokens each into it; then `--rounds` times a fresh server (empty in-process tiers, the
same Redis) gets the schema (uploaded, or from Redis's registry) and one streamed question per module
(`max_tokens` 1, fidelity `fast`: the module's KV as encoded), each module's first use there, so its KV comes from
Redis. TTFT is the client's. A build is a source tree run with PYTHONPATH pointing at it
(a git worktree of another commit). JSON lines under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from benchmarks.evalset.data import make_documents
from benchmarks.harness import RESULTS, emit, log
from benchmarks.live_server import RedisServer, start_promptcache, stream_completion

SYSTEM = "Answer the question with a short phrase, using only the document."


def workload(num_docs: int) -> tuple[str, list[str]]:
    """(a schema of `num_docs` modules of ten generated documents each, one PML question per module)."""
    modules, prompts = [], []
    for index in range(num_docs):
        documents = make_documents(10, seed=100 + index)
        modules.append(f'<module name="d{index}">' + "\n\n".join(d.text for d in documents) + "\n\n</module>")
        prompts.append(f'<prompt schema="docs"><d{index}/>Who is the mayor of {documents[3].town}?\nAnswer:</prompt>')
    return f'<schema name="docs">{SYSTEM}\n\n{"".join(modules)}</schema>', prompts


def run_build(name: str, tree: Path, model: str, schema: str, prompts: list[str], rounds: int,
              out: Path) -> list[float]:
    """The TTFTs (ms) of every question on fresh servers of the build at `tree`."""
    env = {"PYTHONPATH": str(tree.resolve())}
    workdir = tempfile.mkdtemp(prefix=f"promptcache-window-replica-{name}-")
    redis = RedisServer(workdir)
    redis.start()
    try:
        schema_file = Path(workdir) / "docs.pml"
        schema_file.write_text(schema)
        encoded = subprocess.run([sys.executable, "-m", "promptcache.cli", "encode", str(schema_file), "--model", model,
                                  "--redis-url", redis.url], capture_output=True, text=True, timeout=900,
                                 env={**os.environ, **env}, cwd=tree)
        if encoded.returncode != 0:
            raise RuntimeError(f"{name}: encode failed: {encoded.stderr[-2000:]}")
        log(f"{name}: {encoded.stdout.strip().splitlines()[-1]}")
        ttfts = []
        for round_ in range(rounds):
            process, url = start_promptcache(["--model", model], env={**env, "PROMPTCACHE_REDIS_URL": redis.url})
            try:
                with httpx.Client(timeout=300) as client:
                    uploaded = client.post(url + "/v1/schemas", json={"pml": schema})
                    if uploaded.status_code != 409:  # 409: a server before it saved it in Redis's registry
                        uploaded.raise_for_status()
                    for index, prompt in enumerate(prompts):
                        streamed = stream_completion(client, url + "/v1/generate",
                                                     {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                      "fidelity": "fast"})
                        cache = next((c["cache"] for c in reversed(streamed.chunks) if c.get("cache")), {})
                        ttfts.append(streamed.ttft_ms)
                        emit({"bench": "window_replica", "build": name, "model": model, "round": round_,
                              "module": index, "ttft_ms": round(streamed.ttft_ms, 1),
                              "tiers": [m.get("tier") for m in cache.get("modules", [])]}, out)
            finally:
                process.terminate()
                process.wait(timeout=60)
        return ttfts
    finally:
        redis.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--builds", nargs="+", required=True, help="NAME=SOURCE_TREE, in the order they run")
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--documents", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "window_replica.jsonl")
    args = parser.parse_args()
    schema, prompts = workload(args.documents)
    medians = {}
    for spec in args.builds:
        name, tree = spec.split("=", 1)
        ttfts = run_build(name, Path(tree), args.model, schema, prompts, args.rounds, args.out)
        medians[name] = statistics.median(ttfts)
        log(f"{name}: median TTFT {medians[name]:.1f} ms over {len(ttfts)} first uses from Redis")
    emit({"bench": "window_replica", "summary": True, "model": args.model,
          "median_ttft_ms": {k: round(v, 1) for k, v in medians.items()}}, args.out)


if __name__ == "__main__":
    main()
