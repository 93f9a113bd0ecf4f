"""Stalls: inter-token gaps of running streams while a big schema uploads and a long prompt prefills.

    python -m benchmarks.stalls [--tokens 4096]

Over HTTP against `promptcache serve` (default SmolLM2, CPU): 4 clients stream long generations
(ignore_eos); the client records the gap between consecutive streamed tokens. Phases, each while the
4 streams run: `unloaded` (nothing else), `schema_upload` (a schema of ~4K tokens is uploaded, its
modules encoded), `long_prompt` (a ~4K-token plain prompt is sent). Servers, same run: `adaptive`
(default settings: prompt and encoding tokens share decode steps, as many a step as keep it within
`--max-step-slowdown` decode steps), `fixed_N` for each N in `--fixed-chunks` (N tokens a step) and
`unchunked` (chunks as large as the whole input: what a server without chunked prefill does). Per
phase: p50/p99/max gap and how long the action took; JSON lines and a PNG.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import httpx

from benchmarks.harness import RESULTS, emit, log
from benchmarks.live_server import promptcache_server
from benchmarks.serving_workloads import build

STREAMS = 4


def stream(url: str, index: int, stop: threading.Event, gaps: list[float]) -> None:
    prompt = f"Story {index}: once upon a time in a quiet valley,"
    body = {"model": "m", "prompt": prompt, "max_tokens": 4000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        last = None
        for line in response.iter_lines():
            if stop.is_set():
                return
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now


def phase(url: str, name: str, action, settle_s: float) -> dict:
    """Run the 4 streams; after `settle_s`, start recording gaps and run `action` (or wait)."""
    stop = threading.Event()
    gaps: list[list[float]] = [[] for _ in range(STREAMS)]
    threads = [threading.Thread(target=stream, args=(url, i, stop, gaps[i])) for i in range(STREAMS)]
    for t in threads:
        t.start()
    time.sleep(settle_s)
    for g in gaps:
        g.clear()
    started = time.perf_counter()
    action()
    elapsed = time.perf_counter() - started
    stop.set()
    for t in threads:
        t.join(timeout=120)
    flat = sorted(g * 1e3 for gs in gaps for g in gs)
    p99 = flat[min(len(flat) - 1, int(0.99 * len(flat)))] if flat else 0.0
    return {"phase": name, "num_gaps": len(flat), "p50_ms": round(statistics.median(flat), 1) if flat else None,
            "p99_ms": round(p99, 1), "max_ms": round(flat[-1], 1) if flat else None,
            "action_s": round(elapsed, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="size of the schema and of the long prompt")
    parser.add_argument("--unloaded-s", type=float, default=15.0)
    parser.add_argument("--fixed-chunks", default="64",
                        help="comma-separated fixed chunk sizes, one more server each (empty: none)")
    parser.add_argument("--out", type=Path, default=RESULTS / "stalls.jsonl")
    args = parser.parse_args()
    servers = [("adaptive", [])]
    servers += [(f"fixed_{c}", ["--max-step-slowdown", "0", "--max-prefill-tokens", c])
                for c in args.fixed_chunks.split(",") if c]
    servers.append(("unchunked", ["--max-step-slowdown", "0", "--max-prefill-tokens", "1000000",
                                  "--max-prefill-tokens-alone", "1000000"]))
    work = build(doc_repeats=20)
    text = work.document  # ~4K tokens of prose with SmolLM2's tokenizer at 20 documents
    docs = text.split("\n\n")
    modules = "".join(f'<module name="part{i}">{d}\n\n</module>' for i, d in enumerate(docs))
    results: dict[str, list[dict]] = {}
    for name, flags in servers:
        with promptcache_server(flags) as url:
            rows = [phase(url, "unloaded", lambda: time.sleep(args.unloaded_s), 5.0)]
            schema = f'<schema name="big">{modules}</schema>'
            rows.append(phase(url, "schema_upload", lambda url=url, schema=schema: httpx.post(
                url + "/v1/schemas", json={"pml": schema}, timeout=600).raise_for_status(), 5.0))
            rows.append(phase(url, "long_prompt", lambda url=url: httpx.post(
                url + "/v1/completions", json={"model": "m", "prompt": "Fresh. " + text, "max_tokens": 1},
                timeout=600).raise_for_status(), 5.0))
        for row in rows:
            emit({"bench": "stalls", "server": name, **row}, args.out)
            log(json.dumps(row))
        results[name] = rows
    plot(results, args.out.with_suffix(".png"))


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [r["phase"] for r in next(iter(results.values()))]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(results)
    for i, (name, rows) in enumerate(results.items()):
        xs = [p + i * width for p in range(len(phases))]
        ax.bar(xs, [r["max_ms"] for r in rows], width, label=f"{name} max", alpha=0.5)
        ax.bar(xs, [r["p99_ms"] for r in rows], width, label=f"{name} p99")
    ax.set_xticks([p + width * (len(results) - 1) / 2 for p in range(len(phases))], phases)
    ax.set_yscale("log")
    ax.set_ylabel("inter-token gap of 4 streams (ms, log)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
