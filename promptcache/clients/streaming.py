"""Iterators over streamed generations (sync and async), and the server-sent events they are decoded from
(the subset the promptcache server emits, parsed robustly)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Generic, TypeVar

import httpx
from pydantic import BaseModel

from promptcache.clients.base import BaseClient

T = TypeVar("T", bound=BaseModel)


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
            elif line.startswith(":"):
                continue
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)
            # other fields (event:, id:, retry:) are not used by this API

    def flush(self) -> Iterator[str]:
        """The end of the stream ends its last line and event."""
        return self.feed("\n\n")


class _ChunkParser(Generic[T]):
    """SSE text in, typed chunks out; `done` once [DONE] arrives."""

    def __init__(self, model: type[T]) -> None:
        self.model = model
        self.decoder = SSEDecoder()
        self.done = False

    def feed(self, text: str | None) -> list[T]:
        chunks: list[T] = []
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


class Stream(Generic[T]):
    """Iterate chunks of a streamed response; closes the connection at the end or on `close()`."""

    def __init__(self, response: httpx.Response, model: type[T]) -> None:
        self.response = response
        self.model = model

    def __iter__(self) -> Iterator[T]:
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

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncStream(Generic[T]):
    """Async iteration over streamed chunks."""

    def __init__(self, response: httpx.Response, model: type[T]) -> None:
        self.response = response
        self.model = model

    async def __aiter__(self) -> AsyncIterator[T]:
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

    async def __aenter__(self) -> AsyncStream[T]:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
