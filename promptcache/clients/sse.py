"""Server-sent events decoding (the subset the promptcache server emits, parsed robustly)."""

from __future__ import annotations

from collections.abc import Iterator


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
        if self._buffer:
            yield from self.feed("\n")
        if self._data:
            yield "\n".join(self._data)
            self._data = []
