"""Closed-loop streaming clients for the load benchmark: each sends its next request when the last ends."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestSample:
    """One streamed request as its client saw it (perf_counter seconds)."""

    started: float
    ended: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of each chunk carrying text
    num_tokens: int = 0  # the server's usage count when reported, else the chunks carrying text
    error: str | None = None


async def stream_request(client: httpx.AsyncClient, url: str, body: dict) -> RequestSample:
    """POST `body` streamed (usage requested) and time every chunk that carries text; an HTTP error or
    an error event is recorded in the sample, not raised."""
    sample = RequestSample(time.perf_counter())
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                sample.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return sample
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    sample.error = str(chunk["error"])[:200]
                    break
                for choice in chunk.get("choices") or []:
                    if choice.get("text") or (choice.get("delta") or {}).get("content"):
                        sample.token_times.append(time.perf_counter())
                usage_tokens = (chunk.get("usage") or {}).get("completion_tokens", usage_tokens)
    except httpx.HTTPError as exc:
        sample.error = f"{type(exc).__name__}: {exc}"[:200]
    sample.ended = time.perf_counter()
    sample.num_tokens = usage_tokens if usage_tokens is not None else len(sample.token_times)
    return sample


async def run_clients(url: str, path: str, make_body: Callable[[int], dict], *, num_clients: int,
                      duration_s: float, grace_s: float,
                      max_requests: int = 100_000) -> tuple[list[RequestSample], float, float]:
    """`num_clients` closed loops for `duration_s`: a client starts a request only inside the window (and
    while fewer than `max_requests` were started) and waits at most `grace_s` past its end for the last
    one. `make_body(n)` builds request n (a counter shared by all clients). Returns every sample and the
    window (start, end)."""
    counter = iter(range(max_requests))
    # A new connection per request: llama-server may close a kept-alive one just as it is reused (seen as
    # "Server disconnected without sending a response"); on loopback a connect costs well under a millisecond.
    limits = httpx.Limits(max_connections=num_clients, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(duration_s + grace_s), limits=limits) as client:
        started = time.perf_counter()
        ends = started + duration_s
        samples: list[RequestSample] = []

        async def loop() -> None:
            while time.perf_counter() < ends and (n := next(counter, None)) is not None:
                samples.append(await stream_request(client, url + path, make_body(n)))

        tasks = [asyncio.create_task(loop()) for _ in range(num_clients)]
        _, pending = await asyncio.wait(tasks, timeout=duration_s + grace_s)
        for task in pending:  # a request still running past the grace period: dropped, counted below
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return samples, started, ends


def summarize(samples: list[RequestSample], started: float, ends: float) -> dict:
    """req/s: requests that finished inside the window; tok/s: generated tokens (the usage count) that
    arrived inside it, a request's tokens spread over its text chunks (a token with no text of its own, e.g.
    an end-of-text token under `ignore_eos`, arrives in no chunk of its own, and a server that sends none
    for it generated it all the same); TTFT and inter-token gaps (ms) between text chunks, over requests
    that started inside it and finished without error."""
    duration = ends - started
    good = [s for s in samples if s.error is None and s.ended]
    done = [s for s in good if s.ended <= ends]
    arrivals = sum(s.num_tokens * sum(1 for t in s.token_times if t <= ends) / len(s.token_times)
                   for s in good if s.token_times)
    ttft = [(s.token_times[0] - s.started) * 1e3 for s in good if s.token_times]
    gaps = [(b - a) * 1e3 for s in good for a, b in zip(s.token_times, s.token_times[1:])]
    return {"duration_s": round(duration, 2), "num_requests": len(done), "num_errors": len(samples) - len(good),
            "req_per_s": round(len(done) / duration, 3), "tok_per_s": round(arrivals / duration, 2),
            "tokens_per_request": statistics.median([s.num_tokens for s in done]) if done else None,
            **_percentiles("ttft_ms", ttft), **_percentiles("itl_ms", gaps),
            "errors": sorted({s.error for s in samples if s.error})[:3]}


def _percentiles(name: str, values: list[float]) -> dict:
    if not values:
        return {f"{name}_p50": None, f"{name}_p99": None}
    ordered = sorted(values)
    return {f"{name}_p50": round(statistics.median(ordered), 2),
            f"{name}_p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2)}
