"""The SDK's pure logic, shared by Client and AsyncClient: requests, responses, retries, and the iterators over
streamed generations with the server-sent events they are decoded from (the subset the server emits)."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote, urlencode

import httpx
from pydantic import BaseModel

from promptcache.clients.errors import APIConnectionError, APITimeoutError, error_for

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
# The server did not act on the request: safe to send again, whatever the method.
NOT_PROCESSED_STATUSES = frozenset({408, 429, 503})
# The request may have run (a POST could generate or upload twice): only idempotent methods retry.
MAYBE_PROCESSED_STATUSES = frozenset({500, 502, 504})
INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0
MAX_RETRY_AFTER_S = 60.0
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class RequestSpec:
    method: str
    path: str
    json: dict[str, Any] | None = None
    stream: bool = False


class BaseClient:
    """Everything but sending and sleeping."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float, max_retries: int) -> None:
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "promptcache-python"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    @staticmethod
    def body(**fields: Any) -> dict[str, Any]:
        """JSON body without the fields left unset (None)."""
        return {k: v for k, v in fields.items() if v is not None}

    @staticmethod
    def should_retry(attempt: int, max_retries: int, *, method: str, status: int | None = None,
                     error: Exception | None = None) -> bool:
        """Retry only what cannot run twice by accident: a connection that never reached the server,
        408/429/503 (the server did not act; 429/503 send Retry-After), and, for idempotent methods
        only, 5xx and errors after the request was sent. A POST that got a 500 is never retried."""
        if attempt >= max_retries:
            return False
        idempotent = method.upper() in IDEMPOTENT_METHODS
        if error is not None:
            if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout)):
                return True  # nothing was sent
            return idempotent and isinstance(error, (httpx.TransportError, httpx.TimeoutException))
        return status in NOT_PROCESSED_STATUSES or (idempotent and status in MAYBE_PROCESSED_STATUSES)

    def raise_unless_retried(self, attempt: int, spec: RequestSpec, error: httpx.TransportError) -> None:
        """After `error` sending `spec`: return when it should be retried, else raise the SDK's error for it."""
        if self.should_retry(attempt, self.max_retries, method=spec.method, error=error):
            return
        if isinstance(error, httpx.TimeoutException):
            raise APITimeoutError(f"{spec.method} {spec.path} timed out") from error
        raise APIConnectionError(f"{spec.method} {spec.path}: {error}") from error

    @staticmethod
    def backoff_s(attempt: int, retry_after: str | None = None, *, rng: random.Random | None = None) -> float:
        """Seconds before retry `attempt + 1`: the server's Retry-After, else exponential with jitter; capped."""
        if retry_after is not None:
            try:
                return min(max(float(retry_after), 0.0), MAX_RETRY_AFTER_S)
            except ValueError:
                pass
        base = min(INITIAL_BACKOFF_S * 2 ** attempt, MAX_BACKOFF_S)
        return base * (0.75 + 0.5 * (rng or random).random())

    @staticmethod
    def generate_body(prompt: str, *, stream: bool, return_spans: bool = False, **options: Any) -> dict[str, Any]:
        """The /v1/generate body: `options` are generate's other keyword arguments (None: unset)."""
        return BaseClient.body(prompt=prompt, **options, return_spans=True if return_spans else None,
                               stream=True if stream else None)

    @staticmethod
    def fidelity_path(name: str, **options: Any) -> str:
        """GET path of a schema's fidelity report, with the options that are set as its query."""
        query = urlencode({k: v for k, v in options.items() if v is not None})
        return f"/v1/schemas/{quote(name, safe='')}/fidelity" + (f"?{query}" if query else "")

    @staticmethod
    def raise_for_status(response: httpx.Response) -> None:
        if response.status_code < 400:
            return
        try:
            body: Any = response.json()
        except ValueError:
            body = response.text
        raise error_for(response.status_code, body)

    @staticmethod
    def parse(response: httpx.Response, model: type[M]) -> M:
        return model.model_validate(response.json())

    @staticmethod
    def decode_event(data: str, model: type[M]) -> M | None:
        """One SSE data payload -> a chunk; None at [DONE]; raises the mapped error for error events."""
        if data == "[DONE]":
            return None
        payload = json.loads(data)
        if isinstance(payload, dict) and "error" in payload:
            raise error_for(int(payload["error"].get("status", 500)), payload)
        return model.model_validate(payload)


class SSEDecoder:
    """Feed text chunks (any split); yields each event's data string. Comment lines are skipped,
    multi-line data is joined with newlines, events end at a blank line."""

    def __init__(self) -> None:
        self._buffer = ""
        self._data: list[str] = []

    def feed(self, chunk: str) -> Iterator[str]:
        self._buffer += chunk.replace("\r\n", "\n").replace("\r", "\n")
        while "\n" in self._buffer:
            line, self._buffer = self._buffer.split("\n", 1)
            if line == "":
                if self._data:
                    yield "\n".join(self._data)
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[6:] if line.startswith("data: ") else line[5:])
            # comments (":...") and other fields (event:, id:, retry:) are not used by this API

    def flush(self) -> Iterator[str]:
        """The end of the stream ends its last line and event."""
        return self.feed("\n\n")


class _ChunkParser(Generic[M]):
    """SSE text in, typed chunks out; `done` once [DONE] arrives."""

    def __init__(self, model: type[M]) -> None:
        self.model = model
        self.decoder = SSEDecoder()
        self.done = False

    def feed(self, text: str | None) -> list[M]:
        chunks: list[M] = []
        events = self.decoder.feed(text) if text is not None else self.decoder.flush()
        for data in events:
            if self.done:
                break
            chunk = BaseClient.decode_event(data, self.model)
            if chunk is None:
                self.done = True
            else:
                chunks.append(chunk)
        return chunks


class Stream(Generic[M]):
    """Iterate chunks of a streamed response; closes the connection at the end or on `close()`."""

    def __init__(self, response: httpx.Response, model: type[M]) -> None:
        self.response = response
        self.model = model

    def __iter__(self) -> Iterator[M]:
        parser = _ChunkParser(self.model)
        try:
            for text in self.response.iter_text():
                yield from parser.feed(text)
                if parser.done:
                    return
            yield from parser.feed(None)
        finally:
            self.close()

    def close(self) -> None:
        self.response.close()

    def __enter__(self) -> Stream[M]:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncStream(Generic[M]):
    """Async iteration over streamed chunks."""

    def __init__(self, response: httpx.Response, model: type[M]) -> None:
        self.response = response
        self.model = model

    async def __aiter__(self) -> AsyncIterator[M]:
        parser = _ChunkParser(self.model)
        try:
            async for text in self.response.aiter_text():
                for chunk in parser.feed(text):
                    yield chunk
                if parser.done:
                    return
            for chunk in parser.feed(None):
                yield chunk
        finally:
            await self.close()

    async def close(self) -> None:
        await self.response.aclose()

    async def __aenter__(self) -> AsyncStream[M]:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
