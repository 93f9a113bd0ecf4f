"""Serving benchmark over HTTP: the workload of the llama.cpp comparison, TTFT from the client's clock.

    python -m benchmarks.serving [--peer-url http://127.0.0.1:8080 --peer-name llama.cpp]

Starts `promptcache serve` (the default SmolLM2-135M-Instruct, CPU) twice — prefix caching on, and off
(`--no-prefix-caching`, to price the lookup on a full miss) — and optionally measures a peer
OpenAI-compatible server already running (e.g. llama.cpp's llama-server) on the same rows. TTFT is the
time from sending the request to the first streamed token, measured by this client (parsing,
tokenization and HTTP included). Rows:
  a_cold        a ~2K-token plain prompt never seen before
  b_repeat      the exact same prompt again
  b_question    the same ~2K-token document with a new question
  c_plain       8 of 20 documents in random order + a question, as plain chat (prefix reuse only)
  c_pml         the same prompts as PML importing the documents as modules (promptcache only)
  d_turn1..8    an 8-turn chat over a long system message (replies of 32 tokens kept in the history)
One JSON line per (server, row) with the median and every run; a PNG beside the JSON file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

from benchmarks.harness import RESULTS, emit, log
from benchmarks.live_server import start_promptcache
from benchmarks.serving_workloads import Workload, build


class Target:
    """One OpenAI-compatible server and how to time a streamed request on it."""

    def __init__(self, name: str, url: str, *, is_promptcache: bool) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.is_promptcache = is_promptcache
        self.client = httpx.Client(timeout=600)

    def ttft(self, path: str, body: dict) -> tuple[float, str, int | None, float | None]:
        """(TTFT ms, full text, cached prompt tokens if reported, the server's own lookup ms if reported)
        of one streamed request."""
        body = {**body, "stream": True, "temperature": 0}
        if path != "/v1/generate":
            body["stream_options"] = {"include_usage": True}
        started = time.perf_counter()
        first, text, cached, lookup_ms = None, "", None, None
        with self.client.stream("POST", self.url + path, json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"{self.name}: {chunk['error']}")
                for choice in chunk.get("choices") or []:
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if first is None and (piece or choice.get("finish_reason")):
                        first = time.perf_counter()
                    text += piece
                usage = chunk.get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}
                if "cached_tokens" in details:
                    cached = details["cached_tokens"]
                elif "cached_tokens" in usage:
                    cached = usage["cached_tokens"]
                if "timings" in chunk and isinstance(chunk["timings"], dict) and "cache_n" in chunk["timings"]:
                    cached = chunk["timings"]["cache_n"]  # llama.cpp reports reused tokens here
                timings = (chunk.get("promptcache") or chunk.get("cache") or {}).get("timings") or {}
                if "lookup_ms" in timings:
                    lookup_ms = timings["lookup_ms"]
        return ((first or time.perf_counter()) - started) * 1e3, text, cached, lookup_ms


def record(target: Target, row: str, samples: list[tuple[float, str, int | None, float | None]], out: Path,
           medians: dict[str, float]) -> None:
    times = [s[0] for s in samples]
    medians[row] = statistics.median(times)
    lookups = [s[3] for s in samples if s[3] is not None]
    emit({"bench": "serving", "server": target.name, "row": row, "median_ttft_ms": round(medians[row], 1),
          "runs_ms": [round(t, 1) for t in times], "cached_tokens": [s[2] for s in samples],
          **({"lookup_ms": lookups,  # the server's own timer: walking the block index before prefill
              "lookup_share": round(statistics.median(lookups) / medians[row], 5)} if lookups else {})}, out)


def complete(target: Target, prompt: str) -> tuple[float, str, int | None, float | None]:
    return target.ttft("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 1})


def run_cold(targets: list[Target], work: Workload, *, runs: int, out: Path) -> dict[str, dict[str, float]]:
    """Row a on every target, interleaved run by run so that machine drift hits all of them alike."""
    samples: dict[str, list] = {t.name: [] for t in targets}
    for target in targets:
        complete(target, "Warm-up. " + work.document[:400])
    for run in range(runs):
        for target in targets:
            prompt = f"Note {run} of {time.time_ns()} for {target.name}.\n\n{work.document}\n\n{work.questions[0]}"
            samples[target.name].append(complete(target, prompt))
    medians: dict[str, dict[str, float]] = {t.name: {} for t in targets}
    for target in targets:
        record(target, "a_cold", samples[target.name], out, medians[target.name])
    return medians


def run_rows(target: Target, work: Workload, *, runs: int, rows: set[str], out: Path) -> dict[str, float]:
    """Rows b, c, d on one target."""
    medians: dict[str, float] = {}
    if "b" in rows:
        repeat = f"{work.document}\n\n{work.questions[0]}"
        complete(target, repeat)
        record(target, "b_repeat", [complete(target, repeat) for _ in range(runs)], out, medians)
        record(target, "b_question", [complete(target, f"{work.document}\n\n{q}")
                                      for q in work.questions[1: runs + 1]], out, medians)
    if "c" in rows:
        record(target, "c_plain", [target.ttft("/v1/chat/completions", {"model": "m", "messages": m, "max_tokens": 1})
                                   for m in work.retrieval_chat], out, medians)
        if target.is_promptcache:
            target.client.post(target.url + "/v1/schemas", json={"pml": work.retrieval_schema}).raise_for_status()
            # `fast`: modules reused as encoded, whatever the server's default (docs/fidelity.md)
            record(target, "c_pml", [target.ttft("/v1/generate", {"prompt": p, "max_tokens": 1, "fidelity": "fast"})
                                     for p in work.retrieval_pml], out, medians)
    if "d" in rows:
        per_turn: list[list[tuple[float, str, int | None, float | None]]] = [[] for _ in work.chat_turns]
        for session in range(max(1, runs // 2)):
            messages = [{"role": "system", "content": f"Session {session}. {work.chat_system}"}]
            for turn, question in enumerate(work.chat_turns):
                messages.append({"role": "user", "content": question})
                sample = target.ttft("/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 32})
                per_turn[turn].append(sample)
                messages.append({"role": "assistant", "content": sample[1]})
        for turn, samples in enumerate(per_turn, 1):
            record(target, f"d_turn{turn}", samples, out, medians)
    return medians


def plot(results: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted({row for medians in results.values() for row in medians})
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / max(1, len(results))
    for i, (name, medians) in enumerate(results.items()):
        xs = [r + i * width for r in range(len(rows))]
        ax.bar(xs, [medians.get(row, 0) for row in rows], width, label=name)
    ax.set_xticks([r + width * (len(results) - 1) / 2 for r in range(len(rows))], rows, rotation=30, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("median TTFT over HTTP (ms, log)")
    ax.set_title("SmolLM2-135M-Instruct on 2 CPU cores: client-side TTFT")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rows", default="abcd", help="which rows to run (letters a-d)")
    parser.add_argument("--peer-url", help="an OpenAI-compatible server to measure on the same rows")
    parser.add_argument("--peer-name", default="peer")
    parser.add_argument("--no-baseline", action="store_true", help="skip the --no-prefix-caching server")
    parser.add_argument("--out", type=Path, default=RESULTS / "serving.jsonl")
    args = parser.parse_args()
    work, rows = build(), set(args.rows)
    configs = [("promptcache", [])] + ([] if args.no_baseline else [("promptcache-no-prefix", ["--no-prefix-caching"])])
    processes, targets = [], []
    try:
        for name, flags in configs:
            process, url = start_promptcache(flags)
            processes.append(process)
            targets.append(Target(name, url, is_promptcache=True))
        if args.peer_url:
            targets.append(Target(args.peer_name, args.peer_url, is_promptcache=False))
        results = run_cold(targets, work, runs=args.runs, out=args.out) if "a" in rows else \
            {t.name: {} for t in targets}
        for target in targets:
            if target.name != "promptcache-no-prefix":
                log(f"{target.name}: rows {sorted(rows - {'a'})}")
                results[target.name].update(run_rows(target, work, runs=args.runs, rows=rows, out=args.out))
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
    plot(results, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
