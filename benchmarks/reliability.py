"""Reliability over HTTP: fuzzed input never gets a 5xx; 64 clients survive Redis dying mid-run.

    python -m benchmarks.reliability [--fuzz 3000 --clients 64 --duration-s 60 --outage-s 10]

fuzz: schemas and prompts generated from valid PML by random mutation (broken markup, unknown tags and
attributes, huge or negative numbers, unicode, control characters, deep nesting, entities, oversized
arguments), plus random sampling fields; every answer must be a 2xx or a 4xx with an error body.
load: a real redis-server (schemas and KV shared through it); 64 clients send PML and plain prompts
for `duration_s`; Redis is killed after a third of it and restarted `outage_s` later. Every answer must
be a 200 whose greedy text equals the answer the same prompt got before the run (the server runs fp32
by default here: bf16 answers depend on the batch they are computed in).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.harness import RESULTS, emit, log
from benchmarks.live_server import RedisServer, promptcache_server

SCHEMA = ('<schema name="kb"><system>Answer briefly.</system><user>'
          '<module name="cats">Cats sleep up to sixteen hours a day.</module>'
          '<module name="rome">Rome was founded, by legend, in 753 BC.</module>'
          '<module name="trip">Plan <param name="days" len="4"/> days in <param name="city" len="6"/>.</module>'
          "</user></schema>")
PROMPTS = ['<prompt schema="kb"><user><cats/>Who sleeps?</user><assistant/></prompt>',
           '<prompt schema="kb"><user><rome/><cats/>When was Rome founded?</user><assistant/></prompt>',
           '<prompt schema="kb"><user><trip days="3" city="Oslo"/>Go.</user><assistant/></prompt>']
JUNK = ["<", ">", "&", "&amp;", "&#0;", "\x00", "\x1f", "\u202e", "😀", "<![CDATA[x]]>", "<!--", "-->",
        '<!DOCTYPE x [<!ENTITY e "e">]>', "&e;", "<?pi x?>", "<unknown/>", "<cats", "</user>", "<module>",
        '<param name="p" len="-1"/>', '<param name="p" len="99999999999"/>', 'name="1bad"', "<union>",
        '<scaffold modules="cats nope"/>', "<system>", "<assistant>", "x" * 5000, "<user>" * 40]


def mutate(text: str, rng: random.Random) -> str:
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(text) + 1)
        op = rng.random()
        if op < 0.4:
            text = text[:i] + rng.choice(JUNK) + text[i:]
        elif op < 0.7:
            text = text[:i] + text[i + rng.randint(1, 20):]
        else:
            j = rng.randrange(len(text) + 1)
            text = text[:i] + text[j:j + rng.randint(1, 30)] + text[i:]
    return text


def fuzz(url: str, count: int, rng: random.Random) -> dict:
    client = httpx.Client(timeout=120)
    statuses: dict[int, int] = {}
    server_errors = []
    for n in range(count):
        kind = rng.random()
        if kind < 0.3:
            name = f"f{n}"
            path, body = "/v1/schemas", {"pml": mutate(SCHEMA.replace('name="kb"', f'name="{name}"'), rng)}
        elif kind < 0.8:
            path = "/v1/generate"
            body = {"prompt": mutate(rng.choice(PROMPTS), rng), "max_tokens": rng.choice([1, 2, -1, 0, 10**9]),
                    rng.choice(["temperature", "top_p", "seed", "n", "top_k"]): rng.choice(
                        [0, 1e-40, -1, 2**64, 0.5, 17, "x", None, 1e308])}
        else:
            path = rng.choice(["/v1/completions", "/v1/chat/completions", "/v1/prompts/explain"])
            text = mutate(rng.choice(PROMPTS), rng)
            body = {"prompt": text, "messages": [{"role": rng.choice(["user", "system", "bogus"]), "content": text}],
                    "max_tokens": 2, "schema": rng.choice([None, "kb", "nope"])}
        response = client.post(url + path, json=body)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code >= 500:
            server_errors.append({"path": path, "status": response.status_code, "body": response.text[:300]})
        elif response.status_code >= 400 and "error" not in response.json():
            server_errors.append({"path": path, "status": response.status_code, "body": "no error body"})
        if path == "/v1/schemas" and response.status_code == 201:
            client.delete(url + f"/v1/schemas/{body['pml'].split(chr(34))[1]}")
    return {"requests": count, "statuses": statuses, "server_errors": len(server_errors),
            "examples": server_errors[:5]}


def load(url: str, redis: RedisServer, *, clients: int, duration_s: float, outage_s: float) -> dict:
    requests = [("/v1/generate", {"prompt": p, "max_tokens": 4, "temperature": 0}) for p in PROMPTS]
    requests += [("/v1/completions", {"prompt": f"Fact {i}: the sky is", "max_tokens": 4, "temperature": 0})
                 for i in range(3)]
    expected = [httpx.post(url + path, json=body, timeout=120).json()["choices"][0]["text"] for path, body in requests]
    counts = {"ok": 0, "errors": 0, "wrong": 0}
    examples: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + duration_s

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=120) as http:
            while time.monotonic() < deadline:
                index = rng.randrange(len(requests))
                path, body = requests[index]
                try:
                    response = http.post(url + path, json=body)
                    ok = response.status_code == 200
                    text = response.json()["choices"][0]["text"] if ok else response.text[:200]
                except httpx.HTTPError as exc:
                    ok, text = False, repr(exc)
                with lock:
                    if not ok:
                        counts["errors"] += 1
                        examples.append(text)
                    elif text != expected[index]:
                        counts["wrong"] += 1
                        examples.append(f"wrong: {text!r} != {expected[index]!r}")
                    else:
                        counts["ok"] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(duration_s / 3)
    log("killing Redis")
    redis.kill()
    time.sleep(outage_s)
    log("restarting Redis")
    redis.start()
    for t in threads:
        t.join()
    return {"clients": clients, "duration_s": duration_s, "outage_s": outage_s, **counts, "examples": examples[:5]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fuzz", type=int, default=3000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--outage-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    # fp32 by default: its answers do not depend on the batch. bf16 matmuls round differently with the batch
    # size, so a greedy near-tie can flip between an answer computed alone and one computed in a batch.
    parser.add_argument("--dtype", default="float32", help="the server's --dtype (auto: bf16 where native)")
    parser.add_argument("--out", type=Path, default=RESULTS / "reliability.jsonl")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(tmp)
        redis.start()
        try:
            with promptcache_server(["--redis-url", redis.url, "--dtype", args.dtype]) as url:
                httpx.post(url + "/v1/schemas", json={"pml": SCHEMA}, timeout=300).raise_for_status()
                emit({"bench": "reliability", "test": "fuzz", **fuzz(url, args.fuzz, random.Random(args.seed))},
                     args.out)
                emit({"bench": "reliability", "test": "redis_outage",
                      **load(url, redis, clients=args.clients, duration_s=args.duration_s, outage_s=args.outage_s)},
                     args.out)
        finally:
            redis.kill()


if __name__ == "__main__":
    main()
