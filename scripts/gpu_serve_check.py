"""`promptcache serve --device DEVICE` answering a PML request, a chat request and its exact repeat
(scripts/gpu_check.sh step 6). Offline: a tiny random-weight Llama with the in-process test tokenizer is
saved to a temporary directory and served with the bundled example schemas preloaded (module encoding
on the device at startup). The chat asks for repetition, presence and frequency penalties, so the repeat
(its first token sampled from cached CPU logits) exercises sampling state moving to the device.
Then `--requests` more (PML and chat, 16 at a time, eight prompts cycling so the caches reach their
steady state early): the GPU's used memory (nvidia-smi) and the server's RSS after the first fifth and
at the end, which must not grow by more than 64 MB or 2 % on the GPU (a leak per request would).
Prints one JSON line per check; exits 1 on the first failure.

    python scripts/gpu_serve_check.py --device cuda [--requests 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.live_server import free_port
from tests.model_factories import make_test_tokenizer, make_tiny_model

SCHEMA = ('<schema name="harbour"><system>You answer from the minutes.</system><user>'
          '<module name="minutes">The committee met to review the harbour plans and the breakwater.</module>'
          '</user></schema>')
PROMPT = '<prompt schema="harbour"><user><minutes/>What was reviewed?</user><assistant/></prompt>'
CHAT = {"messages": [{"role": "user", "content": "Plan a trip of three days to Paris."}], "max_tokens": 8,
        "temperature": 0, "repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.4}


def save_model(directory: Path) -> None:
    tokenizer = make_test_tokenizer()
    make_tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def wait_ready(process: subprocess.Popen, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"promptcache serve exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"promptcache serve was not ready after {timeout_s:.0f} s")


def check(client: httpx.Client, name: str, path: str, body: dict) -> dict:
    started = time.perf_counter()
    response = client.post(path, json=body)
    record = {"check": name, "status": response.status_code, "ms": round((time.perf_counter() - started) * 1e3, 1)}
    answer = response.json()
    if response.status_code >= 300:
        record["error"] = answer
    elif "choices" in answer:
        choice = answer["choices"][0]
        record["text"] = choice.get("text") if "text" in choice else choice["message"]["content"]
        record["usage"] = answer.get("usage")
    print(json.dumps(record), flush=True)
    if response.status_code >= 300:
        raise RuntimeError(f"{name}: HTTP {response.status_code}")
    return record


def used_memory_mb(pid: int) -> dict:
    """The GPU's used memory (nvidia-smi, the whole device: this client holds none) and `pid`'s RSS, in MB."""
    found: dict = {}
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
        if smi.returncode == 0 and smi.stdout.strip():
            found["gpu_mb"] = float(smi.stdout.split()[0])
    with open(f"/proc/{pid}/status") as status:
        rss_kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return found | {"rss_mb": round(rss_kb / 1024, 1)}


def load(url: str, requests: int, pid: int) -> None:
    """`requests` PML and chat requests, 16 at a time; memory after the first fifth and at the end."""
    bodies = [("/v1/generate", {"prompt": PROMPT.replace("What was reviewed?", f"What was reviewed, item {i}?"),
                                "max_tokens": 8, "temperature": 0}) for i in range(4)]
    bodies += [("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": f"Plan trip {i}."}]})
               for i in range(4)]

    async def run(first: int, last: int, client: httpx.AsyncClient) -> None:
        limit = asyncio.Semaphore(16)

        async def one(i: int) -> None:
            path, body = bodies[i % len(bodies)]
            async with limit:
                response = await client.post(path, json=body)
            if response.status_code != 200:
                raise RuntimeError(f"request {i}: HTTP {response.status_code}")

        await asyncio.gather(*(one(i) for i in range(first, last)))

    async def main() -> tuple[dict, dict, float]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            await run(0, requests // 5, client)
            warm = used_memory_mb(pid)
            started = time.perf_counter()
            await run(requests // 5, requests, client)
            return warm, used_memory_mb(pid), time.perf_counter() - started

    warm, end, seconds = asyncio.run(main())
    record = {"check": "memory", "requests": requests, "after_first_fifth": warm, "at_end": end,
              "requests_per_s": round((requests - requests // 5) / seconds, 1)}
    print(json.dumps(record), flush=True)
    if "gpu_mb" in warm and end["gpu_mb"] - warm["gpu_mb"] > max(64.0, 0.02 * warm["gpu_mb"]):
        raise RuntimeError(f"GPU memory grew from {warm['gpu_mb']} to {end['gpu_mb']} MB over {requests} requests")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--ready-timeout-s", type=float, default=40.0)
    parser.add_argument("--requests", type=int, default=1000, help="requests of the memory check (0: none)")
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as directory:
        save_model(Path(directory))
        command = [sys.executable, "-m", "promptcache.cli", "serve", "--model", directory, "--device", args.device,
                   "--port", str(port), "--log-level", "warning"]
        process = subprocess.Popen(command)
        try:
            wait_ready(process, url, args.ready_timeout_s)
            with httpx.Client(base_url=url, timeout=30) as client:
                check(client, "schema", "/v1/schemas", {"pml": SCHEMA})
                check(client, "pml", "/v1/generate", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
                first = check(client, "chat", "/v1/chat/completions", CHAT)
                again = check(client, "chat_repeat", "/v1/chat/completions", CHAT)
                if again["text"] != first["text"]:
                    raise RuntimeError(f"the exact repeat answered {again['text']!r}, first {first['text']!r}")
            if args.requests:
                load(url, args.requests, process.pid)
        except (RuntimeError, httpx.HTTPError, KeyError, ValueError) as error:
            print(json.dumps({"check": "failed", "error": str(error)}), flush=True)
            return 1
        finally:
            process.terminate()
            process.wait(timeout=20)
    print(json.dumps({"check": "passed", "device": args.device}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
