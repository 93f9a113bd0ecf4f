"""Fairness over HTTP: tenant B's TTFT while tenant A floods the same server.

    python -m benchmarks.fairness [--b-requests 100 --b-interval-s 0.25 --a-clients 16 --a-prompts 16]

One `promptcache serve` with an API-keys file (tenants alpha and beta). First B alone: `b_requests`
single-prompt streamed completions, `b_interval_s` apart, each prompt new (client-side TTFT). Then A alone
for `a_alone_s`: `a_clients` clients sending lists of `a_prompts` prompts back to back (a 429 is honoured
by sleeping its Retry-After). Then A floods again, after one request holding ~2 MiB of prompts (the
server must answer it with a 4xx or serve it without stalling anyone), while B repeats its requests and a
prober reads /health every 100 ms. Reported: B's TTFT p50/p99 alone and under the flood and their
ratios, A's completed prompts per second alone and beside B, 429s, /health p99, and the server's peak
RSS. Every loop is bounded in count and in time (`duration_s`, `a_alone_s`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from benchmarks.harness import RESULTS, emit, log
from benchmarks.live_server import start_promptcache, stream_completion

KEYS = {"sk-alpha": "alpha", "sk-beta": "beta"}
B_PROMPT = "Question {i}: what is the capital of France? Answer in one word.\nAnswer:"  # unique: no repeat hits
A_PROMPT = "Write a long story about a robot who learns to paint, number {i}. " * 4


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": round(statistics.median(values), 1), "p99": round(percentile(values, 0.99), 1)}


class RssSampler(threading.Thread):
    """Peak resident memory of the server process (and its children), sampled every 200 ms."""

    def __init__(self, pid: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.process, self.stop, self.peak_bytes = psutil.Process(pid), stop, 0

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                rss = self.process.memory_info().rss + sum(c.memory_info().rss for c in self.process.children())
            except psutil.Error:
                return
            self.peak_bytes = max(self.peak_bytes, rss)
            self.stop.wait(0.2)


def b_requests(url: str, count: int, deadline: float, first: int = 0,
               interval_s: float = 0.0) -> tuple[list[float], int]:
    """B's streamed single-prompt completions, one after another, each prompt new (numbered from
    `first`, so no request is an exact repeat) and `interval_s` apart; returns TTFTs (ms) and failures."""
    ttfts, failures = [], 0
    headers = {"Authorization": "Bearer sk-beta"}
    with httpx.Client(timeout=120, headers=headers) as client:
        for i in range(first, first + count):
            if time.monotonic() > deadline:
                break
            try:
                body = {"model": "default", "prompt": B_PROMPT.format(i=i), "max_tokens": 8, "temperature": 0}
                ttfts.append(stream_completion(client, url + "/v1/completions", body).ttft_ms)
            except (RuntimeError, httpx.HTTPError) as exc:
                failures += 1
                log(f"B failed: {exc}")
            time.sleep(interval_s)
    return ttfts, failures


def huge_request(url: str) -> dict:
    """One /v1/completions request of ~2 MiB of short prompts from A: its status and how long it took."""
    prompts = ["Hi"] * 400_000  # ~2.4 MB of JSON, within the body limit
    started = time.perf_counter()
    try:
        response = httpx.post(url + "/v1/completions", timeout=120, headers={"Authorization": "Bearer sk-alpha"},
                              json={"model": "default", "prompt": prompts, "max_tokens": 1})
        status = response.status_code
    except httpx.HTTPError as exc:
        status = f"error: {type(exc).__name__}"
    return {"status": status, "seconds": round(time.perf_counter() - started, 3)}


class Flooder(threading.Thread):
    """One of A's clients: lists of prompts back to back until `stop`."""

    def __init__(self, url: str, index: int, prompts: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.index, self.prompts, self.stop = url, index, prompts, stop
        self.completed_prompts = self.rejected = self.errors = 0

    def run(self) -> None:
        headers = {"Authorization": "Bearer sk-alpha"}
        with httpx.Client(timeout=300, headers=headers) as client:
            i = 0
            while not self.stop.is_set():
                prompts = [A_PROMPT.format(i=self.index * 10_000 + i + j) for j in range(self.prompts)]
                i += self.prompts
                try:
                    response = client.post(self.url + "/v1/completions",
                                           json={"model": "default", "prompt": prompts, "max_tokens": 16})
                except httpx.HTTPError:
                    self.errors += 1
                    continue
                if response.status_code == 200:
                    self.completed_prompts += len(response.json()["choices"])
                elif response.status_code == 429:
                    self.rejected += 1
                    self.stop.wait(min(float(response.headers.get("retry-after", "1")), 5.0))
                else:
                    self.errors += 1
                    log(f"A got {response.status_code}: {response.text[:200]}")


class HealthProbe(threading.Thread):
    def __init__(self, url: str, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.latencies_ms, self.failures = url, stop, [], 0

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stop.is_set():
                started = time.perf_counter()
                try:
                    ok = client.get(self.url + "/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies_ms.append((time.perf_counter() - started) * 1e3)
                self.failures += not ok
                self.stop.wait(0.1)


def flood_alone(url: str, args: argparse.Namespace, *, stop_after_s: float) -> float:
    """A's flood with B silent for `stop_after_s` seconds: A's completed prompts per second."""
    stop = threading.Event()
    flooders = [Flooder(url, 100 + i, args.a_prompts, stop) for i in range(args.a_clients)]
    started = time.monotonic()
    for flooder in flooders:
        flooder.start()
    time.sleep(stop_after_s)
    stop.set()
    for flooder in flooders:
        flooder.join(timeout=320)
    return round(sum(f.completed_prompts for f in flooders) / (time.monotonic() - started), 2)


def plot(record: dict, alone: list[float], flooded: list[float], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.boxplot([alone, flooded], whis=(1, 99))
    ax.set_xticks([1, 2], ["B alone", f"B while A floods\n({record['a_clients']} clients)"])
    ax.set_ylabel("B's TTFT (ms, client side)")
    ax.set_title(f"p99 ratio {record['b_p99_ratio']}x; A: {record['a_prompts_per_s']} prompts/s")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--b-requests", type=int, default=100)
    parser.add_argument("--b-interval-s", type=float, default=0.25, help="B's pause between requests")
    parser.add_argument("--a-clients", type=int, default=16)
    parser.add_argument("--a-prompts", type=int, default=16, help="prompts per request of each A client")
    parser.add_argument("--a-alone-s", type=float, default=30, help="seconds A floods with B silent")
    parser.add_argument("--duration-s", type=float, default=90, help="most seconds the flood phase lasts")
    parser.add_argument("--out", type=Path, default=RESULTS / "fairness.jsonl")
    parser.add_argument("server_flags", nargs="*", help="extra `promptcache serve` flags (after --)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        keys_file = Path(tmp) / "keys.json"
        keys_file.write_text(json.dumps(KEYS))
        process, url = start_promptcache(["--api-keys-file", str(keys_file), *args.server_flags])
        try:
            stop = threading.Event()
            rss = RssSampler(process.pid, stop)
            rss.start()
            b_requests(url, 3, time.monotonic() + 60, first=10_000)  # warm-up
            alone, alone_failures = b_requests(url, args.b_requests, time.monotonic() + args.duration_s,
                                               interval_s=args.b_interval_s)
            log(f"B alone: {summary(alone)}")

            a_alone = flood_alone(url, args, stop_after_s=args.a_alone_s)
            log(f"A alone: {a_alone} prompts/s")
            probe = HealthProbe(url, stop)
            probe.start()
            huge = huge_request(url)
            log(f"A's 2 MiB request: {huge}")
            flooders = [Flooder(url, i, args.a_prompts, stop) for i in range(args.a_clients)]
            flood_started = time.monotonic()
            for flooder in flooders:
                flooder.start()
            time.sleep(5)  # let A's queue fill before B measures
            flooded, flooded_failures = b_requests(url, args.b_requests, time.monotonic() + args.duration_s,
                                                   first=args.b_requests, interval_s=args.b_interval_s)
            stop.set()
            for thread in [*flooders, probe, rss]:
                thread.join(timeout=320)
            elapsed = time.monotonic() - flood_started  # A's requests in flight at the stop included
        finally:
            process.terminate()
            process.wait(timeout=60)

    a_prompts = sum(f.completed_prompts for f in flooders)
    record = {
        "bench": "fairness", "a_clients": args.a_clients, "a_prompts_per_request": args.a_prompts,
        "b_alone_ms": summary(alone), "b_flooded_ms": summary(flooded),
        "b_p50_ratio": round(statistics.median(flooded) / statistics.median(alone), 2) if flooded and alone else None,
        "b_p99_ratio": round(percentile(flooded, 0.99) / percentile(alone, 0.99), 2) if flooded and alone else None,
        "b_failures": alone_failures + flooded_failures,
        "a_huge_request": huge, "a_prompts_completed": a_prompts,
        "a_prompts_per_s": round(a_prompts / elapsed, 2), "a_alone_prompts_per_s": a_alone,
        "a_429s": sum(f.rejected for f in flooders),
        "a_errors": sum(f.errors for f in flooders),
        "health_ms": summary(probe.latencies_ms), "health_failures": probe.failures,
        "server_peak_rss_mib": round(rss.peak_bytes / 2**20), "flood_s": round(elapsed, 1),
        "cpu": psutil.cpu_count(),
    }
    emit(record, args.out)
    plot(record, alone, flooded, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
