"""HTTP checks of a running promptcache server, for scripts/docker_check.sh (the CPU image's entrypoint,
then a bare-metal server on the same machine). Prints one JSON line per check; exits 1 on a failure.

    python scripts/docker_check.py checks --url http://127.0.0.1:8000 --api-key K --metrics-key M
    python scripts/docker_check.py ttft --url http://127.0.0.1:8000 --bare-metal-url http://127.0.0.1:8001

`checks`: /health (and its attention path), a schema upload and a PML request whose module comes from the
cache, a chat request and its exact repeat served from the cache, and /metrics.
`ttft`: cold prompts of `--tokens` random token ids (a new draw each time, so nothing is cached), one
token answered, to the container and the bare-metal server in turn; prints each one's median milliseconds
from sending the request to the answer.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import httpx

SCHEMA = ('<schema name="docker-check"><system>Answer briefly, using only the document.</system><user>'
          '<module name="doc-amazon">The Amazon river flows east across South America and empties into the '
          'Atlantic Ocean.</module></user></schema>')
PML = ('<prompt schema="docker-check"><user><doc-amazon/>Into which ocean does the Amazon flow?</user>'
       '<assistant/></prompt>')
CHAT = {"messages": [{"role": "user", "content": "Name the capital of France in one word."}], "max_tokens": 8,
        "temperature": 0}
VOCAB_RANGE = (100, 49_000)  # token ids drawn for cold prompts (SmolLM2's vocabulary has 49,152)


class CheckFailed(RuntimeError):
    pass


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def expect(condition: bool, what: str, seen: object) -> None:
    if not condition:
        raise CheckFailed(f"{what}; got {json.dumps(seen)[:600]}")


def run_checks(client: httpx.Client, metrics_key: str | None) -> None:
    health = client.get("/health").json()
    expect(health.get("status") == "ok" and "attention" in health, "/health is ok and names the attention path",
           health)
    emit({"check": "health", "model": health["model"], "attention": health["attention"]})

    created = client.post("/v1/schemas", json={"pml": SCHEMA})
    expect(created.status_code in (200, 201, 409), "the schema is created (or exists from an earlier run)",
           created.text)
    answer = client.post("/v1/generate", json={"prompt": PML, "max_tokens": 8, "temperature": 0}).json()
    modules = answer.get("cache", {}).get("modules", [])
    expect(any(m["path"] == "doc-amazon" and m["tier"] is not None for m in modules),
           "the PML request reuses the cached module doc-amazon", answer)
    emit({"check": "pml_module_hit", "text": answer["choices"][0]["text"],
          "modules": [(m["path"], m["tier"]) for m in modules]})

    first = client.post("/v1/chat/completions", json=CHAT).json()
    again = client.post("/v1/chat/completions", json=CHAT).json()
    expect("choices" in first and "choices" in again, "chat answers", [first, again])
    text, repeat = first["choices"][0]["message"]["content"], again["choices"][0]["message"]["content"]
    cached = again["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    expect(repeat == text, "the exact repeat answers the same", [text, repeat])
    expect(cached > 0, "the exact repeat is served from the cache (cached_tokens > 0)", again["usage"])
    emit({"check": "chat_and_exact_repeat", "text": text, "repeat_cached_tokens": cached,
          "prompt_tokens": again["usage"]["prompt_tokens"]})

    headers = {"Authorization": f"Bearer {metrics_key}"} if metrics_key else {}
    metrics = client.get("/metrics", headers=headers)
    expect(metrics.status_code == 200 and "promptcache:time_to_first_token_seconds" in metrics.text,
           "/metrics answers with the promptcache series", metrics.status_code)
    emit({"check": "metrics", "bytes": len(metrics.content)})


def cold_prompt_ms(client: httpx.Client, model: str, prompt: list[int]) -> float:
    """Milliseconds to the one-token answer of `prompt`."""
    started = time.perf_counter()
    response = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1,
                                                    "temperature": 0})
    elapsed = (time.perf_counter() - started) * 1e3
    expect(response.status_code == 200, "a cold prompt is answered", response.text)
    return elapsed


def compare_cold_ttft(clients: dict[str, httpx.Client], num_tokens: int, runs: int) -> dict:
    """Cold prompts (random token ids, a new draw each time: nothing cached) sent to each server in turn,
    the order alternating run by run, so load from elsewhere on the machine falls on both alike. The
    first round is a warm-up (first-call allocations) and is not counted."""
    rng = random.Random(num_tokens)
    models = {label: client.get("/v1/models").json()["data"][0]["id"] for label, client in clients.items()}
    times: dict[str, list[float]] = {label: [] for label in clients}
    for run in range(runs + 1):
        order = list(clients) if run % 2 == 0 else list(reversed(clients))
        for label in order:
            prompt = [rng.randrange(*VOCAB_RANGE) for _ in range(num_tokens)]
            elapsed = cold_prompt_ms(clients[label], models[label], prompt)
            if run > 0:
                times[label].append(elapsed)
    record = {"check": "cold_ttft", "tokens": num_tokens}
    for label, client in clients.items():
        record[label] = {"median_ms": round(statistics.median(times[label]), 1),
                         "runs_ms": [round(t, 1) for t in times[label]],
                         "attention": client.get("/health").json().get("attention")}
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["checks", "ttft"])
    parser.add_argument("--url", required=True, help="checks: the server; ttft: the container")
    parser.add_argument("--bare-metal-url", help="ttft: the bare-metal server")
    parser.add_argument("--api-key")
    parser.add_argument("--metrics-key")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    urls = {"container": args.url, "bare_metal": args.bare_metal_url}
    clients = {label: httpx.Client(base_url=url, headers=headers, timeout=300) for label, url in urls.items() if url}
    try:
        if args.mode == "checks":
            run_checks(clients["container"], args.metrics_key)
        else:
            expect("bare_metal" in clients, "ttft compares with a bare-metal server (--bare-metal-url)", args.mode)
            emit(compare_cold_ttft(clients, args.tokens, args.runs))
    except (CheckFailed, httpx.HTTPError, KeyError, ValueError) as error:
        emit({"check": "failed", "mode": args.mode, "error": str(error)})
        return 1
    finally:
        for client in clients.values():
            client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
