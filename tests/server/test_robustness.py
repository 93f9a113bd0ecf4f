"""One request never harms another, over HTTP: bad input is a 4xx, bodies are bounded as they stream,
schema uploads are atomic and replicas follow deletes, the event loop keeps answering."""

from __future__ import annotations

import asyncio
import gc
import http.client
import json
import subprocess
import sys
import threading
import time
import tracemalloc

import httpx
import pytest
import redis
from starlette.types import Message

from promptcache.server import ServerSettings
from promptcache.server.app import RequestGuard
from promptcache.server.tenants import RequestRateLimiter, TenantDirectory
from tests.model_factories import make_test_tokenizer, make_tiny_model
from tests.server.test_api import PROMPT, SCHEMA, UNSPLITTABLE_TEMPLATE


@pytest.mark.parametrize(("field", "value"), [("seed", 2**64), ("seed", -1), ("temperature", 1e-40),
                                              ("stop", ["x"] * 9), ("stop", ["y" * 300])])
def test_bad_sampling_values_are_4xx_naming_the_field(live_server, field, value):
    server = live_server()
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
    response = httpx.post(server.url + "/v1/generate", json={"prompt": PROMPT, "max_tokens": 2, field: value})
    assert response.status_code == 422 and field in response.json()["error"]["message"]
    assert httpx.post(server.url + "/v1/generate", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_body_limit_counts_streamed_bytes(live_server):
    server = live_server(max_request_bytes=4096)

    def chunks():  # chunked transfer encoding: no Content-Length to trust
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 100
        yield b'"}'

    response = httpx.post(server.url + "/v1/generate", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413 and "4096" in response.json()["error"]["message"]
    small = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1})
    assert small.status_code == 200


def test_a_trickled_body_is_held_as_one_buffer_and_reaches_the_route_as_one_message():
    # A body sent a byte per message: the guard keeps its bytes, not the messages (each a dict and a bytes
    # object, ~190 times the byte it carries), and the route reads it whole.
    num_bytes, left = 20_000, 20_000
    seen: list[Message] = []

    async def trickle() -> Message:
        nonlocal left
        left -= 1
        return {"type": "http.request", "body": b"x", "more_body": left > 0}

    async def route(scope, receive, send) -> None:
        seen.append(await receive())
        seen.append({"peak": tracemalloc.get_traced_memory()[1]})

    settings = ServerSettings(max_request_bytes=1 << 20)
    tenants = TenantDirectory({})
    guard = RequestGuard(route, settings, tenants, RequestRateLimiter(tenants))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
    tracemalloc.start()
    try:
        asyncio.run(guard(scope, trickle, lambda message: asyncio.sleep(0)))
    finally:
        tracemalloc.stop()
    assert seen[0] == {"type": "http.request", "body": b"x" * num_bytes, "more_body": False}
    assert seen[1]["peak"] < 20 * num_bytes  # kept per message: ~4 MB


@pytest.mark.parametrize("path", ["/health", "/metrics", "/playground/", "/playground/static/app.js"])
@pytest.mark.parametrize("framing", ["Transfer-Encoding: chunked", "Content-Length: 100000"])
def test_the_open_paths_refuse_a_body_before_reading_it(live_server, path, framing):
    server = live_server()
    conn = http.client.HTTPConnection("127.0.0.1", server.settings.port, timeout=10)
    conn.putrequest("GET", path)
    conn.putheader(*framing.split(": "))
    conn.endheaders(b"5\r\nhello\r\n" if "chunked" in framing else b"hello")  # and the rest never comes
    response = conn.getresponse()  # only a guard that refuses the body unread answers
    assert response.status == 413
    assert json.loads(response.read())["error"]["message"] == f"{path} takes no request body"
    conn.close()
    assert httpx.get(server.url + path).status_code == 200  # without a body it is served


def test_failed_upload_leaves_nothing_and_a_retry_succeeds(live_server, monkeypatch):
    server = live_server()
    service = server.app.state.service
    real = service.runtime.engine.encode_schema
    calls = {"n": 0}

    def flaky(schema, salt=None, **options):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("encoding blew up")
        return real(schema, salt, **options)

    monkeypatch.setattr(service.runtime.engine, "encode_schema", flaky)
    assert httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).status_code == 500
    assert httpx.get(server.url + "/v1/schemas/docs").status_code == 404
    assert httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).status_code == 201


def test_schema_longer_than_the_model_is_refused(live_server):
    server = live_server()
    words = " ".join(["cats sleep"] * 1200)  # > 2048 positions of the tiny model
    response = httpx.post(server.url + "/v1/schemas", json={"pml": f'<schema name="big"><module name="m">{words}'
                                                                    "</module></schema>"})
    assert response.status_code == 400 and "2048" in response.json()["error"]["message"]


def test_replicas_learn_deletes_and_replacements(live_server, redis_server):
    first = live_server(redis_url=redis_server.url, registry_poll_s=0.2)
    second = live_server(redis_url=redis_server.url, registry_poll_s=0.2)
    httpx.post(first.url + "/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
    assert httpx.post(second.url + "/v1/generate", json={"prompt": PROMPT, "max_tokens": 1}).status_code == 200
    assert httpx.delete(first.url + "/v1/schemas/docs").status_code == 204
    replaced = SCHEMA.replace("Cats sleep most of the day.", "Dogs bark at night.")
    httpx.post(first.url + "/v1/schemas", json={"pml": replaced}).raise_for_status()
    new_tokens = httpx.get(first.url + "/v1/schemas/docs").json()["num_tokens"]
    deadline = time.monotonic() + 2.0  # the target: replicas follow within 2 s
    while time.monotonic() < deadline:
        if httpx.get(second.url + "/v1/schemas/docs").json()["num_tokens"] == new_tokens:
            break
        time.sleep(0.1)
    assert second.app.state.service.runtime.get_schema("docs").pml == replaced
    httpx.delete(first.url + "/v1/schemas/docs").raise_for_status()
    time.sleep(1.0)
    assert httpx.post(second.url + "/v1/generate", json={"prompt": PROMPT, "max_tokens": 1}).status_code == 404


def test_a_registry_that_lost_its_data_is_restored_not_followed(live_server, redis_server):
    """Redis restarting without persistence looks like every schema deleted; only a real delete (which
    leaves a tombstone) may drop a schema. The replica keeps serving and writes the schema back."""
    first = live_server(redis_url=redis_server.url, registry_poll_s=0.2)
    httpx.post(first.url + "/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
    redis.Redis.from_url(redis_server.url).flushall()
    time.sleep(1.0)
    assert httpx.post(first.url + "/v1/generate", json={"prompt": PROMPT, "max_tokens": 1}).status_code == 200
    second = live_server(redis_url=redis_server.url)  # starts after the loss: learns the schema from Redis
    assert httpx.post(second.url + "/v1/generate", json={"prompt": PROMPT, "max_tokens": 1}).status_code == 200
    assert httpx.delete(second.url + "/v1/schemas/docs").status_code == 204
    time.sleep(1.0)
    assert httpx.post(first.url + "/v1/generate", json={"prompt": PROMPT, "max_tokens": 1}).status_code == 404


def test_unsplittable_chat_template_still_serves(live_server):
    tokenizer = make_test_tokenizer.__wrapped__()
    tokenizer.chat_template = UNSPLITTABLE_TEMPLATE

    def loader():
        from promptcache.model_runtime import wrap_model

        return wrap_model(make_tiny_model("llama", vocab_size=len(tokenizer)), tokenizer, name="tiny-unsplittable")

    server = live_server(loader)
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 2})
    assert chat.status_code == 200, chat.text
    roles = httpx.post(server.url + "/v1/schemas", json={"pml": '<schema name="r"><system>x</system></schema>'})
    assert roles.status_code == 400 and "role tags" in roles.json()["error"]["message"]
    plain = httpx.post(server.url + "/v1/schemas", json={"pml": '<schema name="p"><module name="m">x</module>'
                                                               "</schema>"})
    assert plain.status_code == 201


def test_long_prompt_placement_and_health_stay_fast(live_server):
    server = live_server(max_request_bytes=4 << 20)
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
    turns = "".join(f"<user>turn {i}</user><assistant>ok {i}</assistant>" for i in range(4000))
    prompt = f'<prompt schema="docs"><user><d1/>Who?</user>{turns}<user>And?</user><assistant/></prompt>'
    seconds = []
    for _ in range(2):  # best of two: the bound is on the algorithm, not on a neighbour's CPU burst
        started = time.perf_counter()
        plan = server.app.state.service.plan(prompt)
        seconds.append(time.perf_counter() - started)
    assert min(seconds) < 1.0 and len(plan.new_runs) > 8000
    # The server shares this process with everything the suite left behind; a full garbage collection over
    # it (stop-the-world) once stalled /health for 0.53 s late in a CI run. Freeze those objects so the
    # bound measures the server, not the suite's heap.
    gc.collect()
    gc.freeze()
    try:
        poller = subprocess.Popen([sys.executable, "-m", "tests.server.health_poller", server.url],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert poller.stdout.readline().strip() == "ready"
        try:
            httpx.post(server.url + "/v1/generate",
                       json={"prompt": prompt, "max_tokens": 1}, timeout=60)
            httpx.post(server.url + "/v1/completions", json={"prompt": "word " * 1500, "max_tokens": 2}, timeout=60)
        finally:
            out, _ = poller.communicate("stop\n", timeout=30)
    finally:
        gc.unfreeze()
    latencies = json.loads(out)
    # Target < 100 ms at p95; on a shared 2-core CI runner one scheduler hiccup is tolerated, not a stall.
    latencies.sort()
    assert len(latencies) >= 10
    assert latencies[int(0.95 * len(latencies))] < 0.1 and latencies[-1] < 0.5


def test_a_client_that_disconnects_frees_its_sequence(live_server, monkeypatch):
    server = live_server()
    engine = server.app.state.service.runtime.engine
    run = engine.runner.run

    def paced_run(*args, **kwargs):  # the tiny model could finish all 2,000 tokens before the client reads 6 lines
        time.sleep(0.005)
        return run(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "run", paced_run)
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        for count, _ in enumerate(response.iter_lines()):
            if count == 5:
                break
        assert engine.num_running == 1
    steps = engine.num_steps
    deadline = time.monotonic() + 5
    while engine.num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.num_running == 0 and engine.num_steps - steps <= 3
    assert engine.scheduler.memory.used_bytes == 0


def test_poison_requests_among_healthy_streams_fail_alone(live_server, monkeypatch):
    """Streams decode while requests that break inside the engine (a module fetch that raises) and
    requests refused at the wire come and go: every stream gets the text it gets alone."""
    server = live_server()
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
    healthy = [{"prompt": f"Story {i}: once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
               for i in range(3)]
    expected = [httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
                for body in healthy]
    encoder = server.app.state.service.runtime.model.module_encoder
    fetch = encoder.fetch

    def broken_fetch(schema, segment_id, context_ids, cache_salt=None, *, reach=None):
        if schema.segments[segment_id].owner == "d2":
            raise RuntimeError("disk on fire")
        return fetch(schema, segment_id, context_ids, cache_salt, reach=reach)

    monkeypatch.setattr(encoder, "fetch", broken_fetch)
    texts: list[str | None] = [None] * len(healthy)

    def stream(index: int) -> None:
        body = {**healthy[index], "prompt": healthy[index]["prompt"], "stream": True}
        parts = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    parts.append(json.loads(line[6:])["choices"][0]["text"])
        texts[index] = "".join(parts)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(healthy))]
    for thread in threads:
        thread.start()
    poisoned = [httpx.post(server.url + "/v1/generate", json={"prompt": PROMPT, "max_tokens": 4}, timeout=60)
                for _ in range(3)]
    refused = httpx.post(server.url + "/v1/generate", json={"prompt": PROMPT, "seed": 2**64})
    for thread in threads:
        thread.join(timeout=60)
    assert all(r.status_code == 500 and "(id " in r.json()["error"]["message"] for r in poisoned), \
        [r.text for r in poisoned]
    assert all("disk on fire" not in r.text for r in poisoned)
    assert refused.status_code == 422
    assert texts == expected
    assert server.app.state.service.runtime.engine.scheduler.memory.used_bytes == 0
