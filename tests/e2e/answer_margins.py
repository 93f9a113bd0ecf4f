"""How firmly the model chose the answers the docs expect. The docs' examples talk to the server through
`RecordingProxy`, which keeps every generation request and its answer; `deciding_margins` asks the server again
for the same greedy answer with each token's two most likely tokens, and returns, for every token up to the end of
an expected string, how far the chosen token's logprob lies above the runner-up's. A greedy near-tie rounds the
other way on another CPU's bf16 path (or in fp32): an example decided by one is fragile, and fails here, on its
author's machine, rather than on a newcomer's."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from tests.redis_server import free_port

GENERATION_PATHS = ("/v1/generate", "/v1/completions", "/v1/chat/completions")
_HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


@dataclass(frozen=True, slots=True)
class Generation:
    """One generation request an example made, and the body it got (JSON, or server-sent events)."""

    path: str
    body: dict
    response: bytes


@dataclass(frozen=True, slots=True)
class TokenMargin:
    token: str
    margin: float  # chosen token's logprob minus the runner-up's (nats); inf when no runner-up is listed


class RecordingProxy:
    """A loopback HTTP proxy in front of `target` that passes everything through (streams too) and records each
    successful generation request. `take()` returns the generations recorded since the last call."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._generations: list[Generation] = []
        self._lock = threading.Lock()
        methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
        app = Starlette(routes=[Route("/{path:path}", self._forward, methods=methods)])
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self) -> RecordingProxy:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert time.monotonic() < deadline, "the recording proxy did not start"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.ident is not None:  # started (a server that never became ready never starts its proxy)
            self._thread.join(timeout=30)

    def take(self) -> list[Generation]:
        with self._lock:
            taken, self._generations = self._generations, []
        return taken

    async def _forward(self, request: Request) -> StreamingResponse:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        client = httpx.AsyncClient(base_url=self.target, timeout=600)
        upstream = await client.send(client.build_request(request.method, request.url.path, params=request.query_params,
                                                          headers=headers, content=body), stream=True)
        chunks: list[bytes] = []

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    chunks.append(chunk)
                    yield chunk
            finally:
                await upstream.aclose()
                await client.aclose()
            if request.method == "POST" and request.url.path in GENERATION_PATHS and upstream.status_code == 200:
                with self._lock:
                    self._generations.append(Generation(request.url.path, json.loads(body), b"".join(chunks)))

        response_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
        return StreamingResponse(relay(), status_code=upstream.status_code, headers=response_headers)


def answers(generation: Generation) -> list[str]:
    """The texts of the generation's choices, by index (streamed deltas joined)."""
    texts: dict[int, str] = {}
    for payload in _payloads(generation.response):
        for choice in payload.get("choices", ()):
            piece = choice.get("text") or (choice.get("message") or choice.get("delta") or {}).get("content") or ""
            texts[choice.get("index", 0)] = texts.get(choice.get("index", 0), "") + piece
    return [texts[i] for i in sorted(texts)]


def is_greedy(generation: Generation) -> bool:
    return generation.body.get("temperature", 1.0) == 0


def deciding_margins(server_url: str, generation: Generation, expected: str) -> list[list[TokenMargin]] | None:
    """For each choice whose answer holds `expected` (any case), the margin of every token up to the end of its first
    occurrence, from the same request asked again with two alternatives per token; None if the request is not
    greedy. Raises AssertionError if the answer asked again differs from the recorded one before that end (past it,
    the default numerics may answer a repeat otherwise: docs/api.md, "Determinism")."""
    if not is_greedy(generation):
        return None
    recorded = answers(generation)
    again = _with_two_alternatives(generation)
    response = httpx.post(server_url + generation.path, json=again, timeout=600)
    assert response.status_code == 200, response.text
    found = []
    for index, choice in enumerate(response.json()["choices"]):
        answer = choice.get("text") if "text" in choice else choice["message"]["content"]
        first = recorded[index] if index < len(recorded) else ""
        if (at := first.lower().find(expected.lower())) < 0:
            continue
        end = at + len(expected)
        assert answer[:end] == first[:end], (
            f"the same greedy request answered {first!r}, then {answer!r}: they part before {expected!r} ends, "
            "a near-tie, or a cache hit changed the answer")
        tokens = _token_margins(generation.path, choice)
        # Token strings spell the answer (and any end-of-sequence token after it): offsets are theirs.
        text = "".join(token.token for token in tokens)
        if (at := text.lower().find(expected.lower())) >= 0:
            end, deciding = at + len(expected), []
            for token in tokens:
                if sum(len(t.token) for t in deciding) >= end:
                    break
                deciding.append(token)
            found.append(deciding)
    return found


def _with_two_alternatives(generation: Generation) -> dict:
    body = {k: v for k, v in generation.body.items() if k not in ("stream", "stream_options")}
    if generation.path == "/v1/chat/completions":
        return {**body, "logprobs": True, "top_logprobs": 2}
    return {**body, "logprobs": 2}


def _token_margins(path: str, choice: dict) -> list[TokenMargin]:
    logprobs = choice["logprobs"]
    if path == "/v1/chat/completions":
        return [TokenMargin(entry["token"], _margin([alt["logprob"] for alt in entry["top_logprobs"]]))
                for entry in logprobs["content"]]
    if path == "/v1/generate":  # alternatives by token id: two tokens that spell alike stay apart
        tops = logprobs["top_token_logprobs"]
    else:
        tops = [list(top.values()) for top in logprobs["top_logprobs"]]
    return [TokenMargin(token, _margin(top)) for token, top in zip(logprobs["tokens"], tops)]


def _margin(top: list[float]) -> float:
    ranked = sorted(top, reverse=True)
    return ranked[0] - ranked[1] if len(ranked) > 1 else float("inf")


def _payloads(body: bytes) -> list[dict]:
    text = body.decode()
    if text.lstrip().startswith("data:"):
        events = [line[len("data:"):].strip() for line in text.splitlines() if line.startswith("data:")]
        return [json.loads(event) for event in events if event != "[DONE]"]
    return [json.loads(text)]
