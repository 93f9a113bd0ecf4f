"""Serving benchmark over HTTP: the workload of the llama.cpp comparison, TTFT from the client's clock.

    python -m benchmarks.serving [--peer-url http://127.0.0.1:8080 --peer-name llama.cpp]
    python -m benchmarks.serving --rows abc --no-baseline --server before= --server after= --source before=/tmp/old

Starts `promptcache serve` (the default SmolLM2-135M-Instruct, CPU) twice — prefix caching on, and off
(`--no-prefix-caching`, to price the lookup on a full miss) — and optionally measures a peer
OpenAI-compatible server already running (e.g. llama.cpp's llama-server) on the same rows. TTFT is the
time from sending the request to the first streamed token, measured by this client (parsing,
tokenization and HTTP included). Rows:
  a_cold        a ~2K-token plain prompt never seen before
  b_repeat      the exact same prompt again
  b_first_question  the first new question over the document after its prompt was computed (one sample: a server
                may pay once here for the document's reuse, e.g. promptcache assembling its blocks)
  b_question    the same ~2K-token document with a new question (after b_first_question)
  c_plain       8 of 20 documents in random order + a question, as plain chat (prefix reuse only)
  c_pml         the same prompts as PML importing the documents as modules (promptcache only), `fast`;
                c_pml_<mode> the same in another fidelity mode (--pml-fidelity)
  d_turn1..8    an 8-turn chat over a long system message (replies of 32 tokens kept in the history)
Several promptcache configurations can run side by side (`--server NAME=FLAGS`, e.g. fp32 against
`--dtype auto`); every row is interleaved sample by sample across the servers, so drift of the machine
hits all of them alike. One JSON line per (server, row) with the median and every run; a PNG beside
the JSON file.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import httpx

from benchmarks.harness import RESULTS, emit, log
from benchmarks.live_server import start_promptcache, stream_completion
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
        streamed = stream_completion(self.client, self.url + path, {**body, "temperature": 0})
        cached, lookup_ms = None, None
        for chunk in streamed.chunks:
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
        return streamed.ttft_ms, streamed.text, cached, lookup_ms


def record(target: Target, row: str, samples: list[tuple[float, str, int | None, float | None]], out: Path,
           medians: dict[str, float]) -> None:
    times = [s[0] for s in samples]
    medians[row] = statistics.median(times)
    lookups = [s[3] for s in samples if s[3] is not None]
    emit({"bench": "serving", "server": target.name, "row": row, "median_ttft_ms": round(medians[row], 1),
          "runs_ms": [round(t, 1) for t in times], "cached_tokens": [s[2] for s in samples],
          **({"lookup_ms": lookups,  # the server's own timer: walking the block index before prefill
              "lookup_share": round(statistics.median(lookups) / medians[row], 5)} if lookups else {})}, out)


def record_store_bytes(target: Target, num_tokens: int, out: Path) -> None:
    """KV bytes per schema token in the device tier right after the retrieval schema's upload into an
    empty server (its modules' KV, nothing else)."""
    metrics = target.client.get(target.url + "/metrics").text
    device = next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("promptcache:cache_usage_bytes") and 'tier="device"' in line)
    emit({"bench": "serving_store", "server": target.name, "schema_tokens": num_tokens,
          "device_bytes": int(device), "bytes_per_token": round(device / num_tokens, 1)}, out)


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


def run_rows(targets: list[Target], work: Workload, *, runs: int, rows: set[str], out: Path,
             pml_fidelity: tuple[str, ...] = ("fast",)) -> dict[str, dict[str, float]]:
    """Rows b, c, d on every target, interleaved sample by sample (drift hits every target alike)."""
    medians: dict[str, dict[str, float]] = {t.name: {} for t in targets}

    def each(row: str, targets_: list[Target], requests: list, send) -> None:
        samples: dict[str, list] = {t.name: [] for t in targets_}
        for request in requests:
            for target in targets_:
                samples[target.name].append(send(target, request))
        for target in targets_:
            record(target, row, samples[target.name], out, medians[target.name])

    if "b" in rows:
        repeat = f"{work.document}\n\n{work.questions[0]}"
        for target in targets:
            complete(target, repeat)
        each("b_repeat", targets, [repeat] * runs, complete)
        first = f"{work.document}\n\n{work.questions[0]} Answer in one word."
        each("b_first_question", targets, [first], complete)
        each("b_question", targets, [f"{work.document}\n\n{q}" for q in work.questions[1: runs + 1]], complete)
    if "c" in rows:
        each("c_plain", targets, work.retrieval_chat, lambda t, m: t.ttft(
            "/v1/chat/completions", {"model": "m", "messages": m, "max_tokens": 1}))
        ours = [t for t in targets if t.is_promptcache]
        # `fast`: modules reused as encoded (at the server's `--fidelity-positions`), whatever its default
        # mode; other modes (--pml-fidelity) as rows of their own
        for mode in pml_fidelity:
            each("c_pml" if mode == "fast" else f"c_pml_{mode}", ours, work.retrieval_pml, lambda t, p, mode=mode:
                 t.ttft("/v1/generate", {"prompt": p, "max_tokens": 1, "fidelity": mode}))
    if "d" in rows:
        per_turn: dict[str, list[list]] = {t.name: [[] for _ in work.chat_turns] for t in targets}
        for session in range(max(1, runs // 2)):
            history = {t.name: [{"role": "system", "content": f"Session {session}. {work.chat_system}"}]
                       for t in targets}
            for turn, question in enumerate(work.chat_turns):
                for target in targets:
                    messages = history[target.name]
                    messages.append({"role": "user", "content": question})
                    sample = target.ttft("/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 32})
                    per_turn[target.name][turn].append(sample)
                    messages.append({"role": "assistant", "content": sample[1]})
        for target in targets:
            for turn, samples in enumerate(per_turn[target.name], 1):
                record(target, f"d_turn{turn}", samples, out, medians[target.name])
    return medians


def plot(results: dict[str, dict[str, float]], path: Path, title: str) -> None:
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
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rows", default="abcd", help="which rows to run (letters a-d)")
    parser.add_argument("--server", action="append", metavar="NAME=FLAGS",
                        help="a promptcache server to start, e.g. 'fp32=--dtype float32' (repeatable; default: "
                             "'promptcache=' and, unless --no-baseline, 'promptcache-no-prefix=--no-prefix-caching')")
    parser.add_argument("--peer-url", help="an OpenAI-compatible server to measure on the same rows")
    parser.add_argument("--peer-name", default="peer")
    parser.add_argument("--no-baseline", action="store_true", help="skip the --no-prefix-caching server")
    parser.add_argument("--pml-fidelity", nargs="+", default=["fast"], metavar="MODE",
                        help="fidelity modes of row c's PML prompts, one row each (e.g. fast balanced exact)")
    parser.add_argument("--source", action="append", default=[], metavar="NAME=DIR",
                        help="run server NAME from the source tree DIR (PYTHONPATH), e.g. a worktree of an older "
                             "commit for a before/after comparison in one run (repeatable)")
    parser.add_argument("--no-role-tags", action="store_true", help="row c's PML without role tags (models whose "
                        "chat template cannot be split per role, e.g. Gemma)")
    parser.add_argument("--title", default="SmolLM2-135M-Instruct on 2 CPU cores: client-side TTFT",
                        help="the PNG's title")
    parser.add_argument("--out", type=Path, default=RESULTS / "serving.jsonl")
    args = parser.parse_args()
    sources = dict(spec.split("=", 1) for spec in args.source)
    work, rows = build(role_tags=not args.no_role_tags), set(args.rows)
    baseline = [] if args.no_baseline else ["promptcache-no-prefix=--no-prefix-caching"]
    specs = args.server or ["promptcache=", *baseline]
    configs = [(name, flags.split()) for name, _, flags in (spec.partition("=") for spec in specs)]
    processes, targets = [], []
    try:
        for name, flags in configs:
            source = {"PYTHONPATH": sources[name]} if name in sources else None
            process, url = start_promptcache(flags, env=source)
            processes.append(process)
            targets.append(Target(name, url, is_promptcache=True))
            log(f"{name}: {url} {' '.join(flags)}{f' from {sources[name]}' if name in sources else ''}")
        for target in targets:  # first, into empty tiers: the device tier then holds the modules' KV only
            response = target.client.post(target.url + "/v1/schemas", json={"pml": work.retrieval_schema})
            response.raise_for_status()
            record_store_bytes(target, response.json()["num_tokens"], args.out)
        if args.peer_url:
            targets.append(Target(args.peer_name, args.peer_url, is_promptcache=False))
        results = run_cold(targets, work, runs=args.runs, out=args.out) if "a" in rows else \
            {t.name: {} for t in targets}
        # rows b-d need prefix caching: a --no-prefix-caching server only prices the lookup in row a
        reusing = [t for t, (_, flags) in zip(targets, [*configs, ("peer", [])]) if "--no-prefix-caching" not in flags]
        for name, medians in run_rows(reusing, work, runs=args.runs, rows=rows, out=args.out,
                                      pml_fidelity=tuple(args.pml_fidelity)).items():
            results[name].update(medians)
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
    plot(results, args.out.with_suffix(".png"), args.title)


if __name__ == "__main__":
    main()
