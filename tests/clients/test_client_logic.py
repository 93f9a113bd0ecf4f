"""SDK logic without a server: request building, error mapping, retries, SSE parsing, imports."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from promptcache.clients import (
    APIConnectionError,
    APITimeoutError,
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    Client,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitError,
    ServiceUnavailableError,
    UnprocessableEntityError,
)
from promptcache.clients.base import MAX_BACKOFF_S, BaseClient, SSEDecoder

GENERATION = {"id": "g1", "choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 5, "cached_tokens": 3, "completion_tokens": 1, "total_tokens": 6},
              "cache": {"exact": True, "modules": [{"path": "d1", "num_tokens": 3, "tier": "device"}]},
              "timings": {"ttft_ms": 1.5, "total_ms": 2.0}}


def mock_client(handler, **kwargs) -> tuple[Client, list[float]]:
    sleeps: list[float] = []
    client = Client("http://server", http_client=httpx.Client(transport=httpx.MockTransport(handler)),
                    sleep=sleeps.append, **kwargs)
    return client, sleeps


def test_request_building_and_parsing():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=GENERATION)

    client, _ = mock_client(handler, api_key="k")
    result = client.generate('<prompt schema="s"/>', max_tokens=4, temperature=0)
    request = seen[0]
    assert request.method == "POST" and request.url.path == "/v1/generate"
    assert request.headers["authorization"] == "Bearer k"
    assert json.loads(request.content) == {"prompt": '<prompt schema="s"/>', "max_tokens": 4, "temperature": 0}
    assert result.text == "hi" and result.usage.cached_tokens == 3 and result.cache.modules[0].tier == "device"


@pytest.mark.parametrize(("status", "cls"), [(400, BadRequestError), (401, AuthenticationError),
                                             (404, NotFoundError), (409, ConflictError), (413, PayloadTooLargeError),
                                             (422, UnprocessableEntityError), (429, RateLimitError),
                                             (500, InternalServerError), (503, ServiceUnavailableError)])
def test_status_errors(status, cls):
    def handler(request):
        return httpx.Response(status, json={"error": {"type": "t", "message": "what went wrong"}})

    client, _ = mock_client(handler, max_retries=0)
    with pytest.raises(cls, match="what went wrong") as info:
        client.schemas.get("x")
    assert info.value.status_code == status and info.value.type == "t"


def test_retries_on_503_and_429_with_backoff_and_retry_after():
    responses = [httpx.Response(503, json={"error": {"type": "loading", "message": "m"}}),
                 httpx.Response(429, headers={"retry-after": "3"}, json={"error": {"type": "r", "message": "m"}}),
                 httpx.Response(200, json={"data": []})]
    client, sleeps = mock_client(lambda request: responses.pop(0), max_retries=2)
    assert client.schemas.list() == []
    assert len(sleeps) == 2 and 0.3 <= sleeps[0] <= 0.7 and sleeps[1] == 3.0


def test_no_retry_on_4xx_and_retries_are_bounded():
    calls = []

    def bad(request):
        calls.append(1)
        return httpx.Response(400, json={"error": {"type": "invalid_pml", "message": "line 1"}})

    client, sleeps = mock_client(bad, max_retries=5)
    with pytest.raises(BadRequestError):
        client.schemas.create("<schema/>")
    assert len(calls) == 1 and sleeps == []

    def down(request):
        raise httpx.ConnectError("refused", request=request)

    client, sleeps = mock_client(down, max_retries=3)
    with pytest.raises(APIConnectionError):
        client.generate("<prompt schema='s'/>")
    assert len(sleeps) == 3


def test_backoff_grows_and_is_capped():
    import random

    rng = random.Random(0)
    waits = [BaseClient.backoff_s(attempt, rng=rng) for attempt in range(10)]
    assert waits[0] < waits[3] and max(waits) <= MAX_BACKOFF_S * 1.25
    assert BaseClient.backoff_s(0, "120") == 60.0 and BaseClient.backoff_s(0, "junk") > 0


def test_sse_decoder_handles_splits_comments_and_multiline():
    decoder = SSEDecoder()
    stream = ': keep-alive\n\ndata: {"a":\ndata: 1}\n\ndata: [DONE]\n\n'
    events = []
    for i in range(0, len(stream), 3):  # split across network chunks anywhere
        events += list(decoder.feed(stream[i:i + 3]))
    assert events == ['{"a":\n1}', "[DONE]"]


def test_streaming_and_in_stream_errors():
    chunk = {"id": "g", "choices": [{"index": 0, "text": "a"}]}
    body = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"
    client, _ = mock_client(lambda r: httpx.Response(200, text=body, headers={"content-type": "text/event-stream"}))
    assert "".join(c.choices[0].text for c in client.generate("<prompt schema='s'/>", stream=True)) == "aa"
    error = 'data: {"error": {"type": "engine_error", "message": "boom", "status": 500}}\n\n'
    client, _ = mock_client(lambda r: httpx.Response(200, text=error))
    with pytest.raises(InternalServerError, match="boom"):
        list(client.generate("<prompt schema='s'/>", stream=True))


async def test_async_client_retries_and_parses():
    responses = [httpx.Response(503, text="loading"), httpx.Response(200, json=GENERATION)]
    sleeps = []

    async def fake_sleep(seconds):
        sleeps.append(seconds)

    client = AsyncClient("http://server", http_client=httpx.AsyncClient(
        transport=httpx.MockTransport(lambda r: responses.pop(0))), sleep=fake_sleep)
    result = await client.generate("<prompt schema='s'/>")
    assert result.text == "hi" and len(sleeps) == 1
    await client.close()


def test_sdk_imports_no_server_dependencies():
    code = ("import sys, promptcache.clients; "
            "print(sorted(m for m in ('torch', 'transformers', 'fastapi', 'lxml') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_post_that_got_a_500_or_lost_its_response_is_never_retried():
    calls = []

    def broken(request):
        calls.append(request.method)
        return httpx.Response(500, json={"error": {"type": "engine_error", "message": "internal error (id x)"}})

    client, sleeps = mock_client(broken, max_retries=3)
    with pytest.raises(InternalServerError):
        client.generate("<prompt schema='s'/>")
    assert calls == ["POST"] and sleeps == []
    calls.clear()
    with pytest.raises(InternalServerError):
        client.schemas.get("x")  # GET is idempotent: retried
    assert calls == ["GET"] * 4

    def read_lost(request):
        calls.append(request.method)
        raise httpx.ReadTimeout("no answer", request=request)

    calls.clear()
    client, sleeps = mock_client(read_lost, max_retries=3)
    with pytest.raises(APITimeoutError):
        client.generate("<prompt schema='s'/>")  # the server may be generating it: not sent twice
    assert calls == ["POST"] and sleeps == []
