"""Many clients at once, and two server processes sharing one Redis."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import httpx

from promptcache.model_runtime import SamplingParams
from tests.conftest import make_tiny_runtime
from tests.model_factories import make_test_tokenizer, make_tiny_model
from tests.model_runtime.oracles import reference_text, reference_tokens
from tests.redis_server import free_port
from tests.server.test_api import SCHEMA


def test_sixteen_concurrent_clients_all_answered_correctly(live_server):
    server = live_server()
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
    prompts = [f'<prompt schema="docs"><user><{d}/>Question number {i}?</user><assistant/></prompt>'
               for i, d in zip(range(20), ["d1", "d2"] * 10)]
    runtime = make_tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema(SCHEMA), encode=False)
    params = SamplingParams(max_tokens=6, temperature=0)
    plans = [runtime.plan(p, add_generation_prompt=True) for p in prompts]  # as the server parses them
    fidelity = server.app.state.service.runtime.engine.config.fidelity  # the server's default mode
    expected = [reference_text(runtime.loaded, reference_tokens(runtime.loaded, plan, params, fidelity))
                for plan in plans]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            responses = await asyncio.gather(*[
                client.post("/v1/generate", json={"prompt": p, "max_tokens": 6, "temperature": 0}) for p in prompts])
        return [r.json()["choices"][0]["text"] for r in responses]

    started = time.monotonic()
    assert asyncio.run(main()) == expected
    assert time.monotonic() - started < 120


def _spawn(model_dir, redis_url: str, port: int, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "promptcache.cli", "serve", "--model", str(model_dir), "--port", str(port),
         "--redis-url", redis_url, "--no-examples", "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_ready(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(process.stderr.read().decode()[-2000:])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server process did not become ready")


def _encodings(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("promptcache:module_encodings_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("module_encodings metric missing")


def test_two_processes_share_schemas_and_kv_through_redis(tmp_path, redis_server):
    tokenizer = make_test_tokenizer()
    make_tiny_model("qwen2", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    env = {**os.environ, "PROMPTCACHE_NAMESPACE": "shared-test"}
    ports = [free_port(), free_port()]
    processes = [_spawn(tmp_path / "model", redis_server.url, port, env) for port in ports]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for url, process in zip(urls, processes):
            _wait_ready(url, process)
        assert httpx.post(urls[0] + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).status_code == 201
        assert _encodings(urls[0]) > 0
        # The second replica never saw the upload: it finds the schema and its KV in Redis.
        body = {"prompt": '<prompt schema="docs"><user><d1/><d2/>Q?</user><assistant/></prompt>', "max_tokens": 4,
                "temperature": 0}
        second = httpx.post(urls[1] + "/v1/generate", json=body, timeout=60)
        assert second.status_code == 200, second.text
        assert {m["tier"] for m in second.json()["cache"]["modules"]} == {"redis"}
        assert _encodings(urls[1]) == 0
        first = httpx.post(urls[0] + "/v1/generate", json=body, timeout=60).json()
        assert first["choices"][0]["text"] == second.json()["choices"][0]["text"]
        assert [s["name"] for s in httpx.get(urls[1] + "/v1/schemas").json()["data"]] == ["docs"]
        assert httpx.post(urls[1] + "/v1/schemas", json={"pml": SCHEMA}).status_code == 409
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
