"""Request bodies decoded and validated in a worker thread, after a structural bound: FastAPI would run `json.loads`
and pydantic over a 2 MiB body on the event loop, and every other request (streams, /health) would wait for it."""

from __future__ import annotations

import asyncio
import email.message
import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from promptcache.server.errors import PayloadTooLargeError

# JSON arrays and objects one body may hold. `json.loads` keeps the GIL for the whole document, so a worker thread
# does not stop it from pausing the loop: 2 MiB of `[1],` is ~500K lists and ~0.3 s of decoding. The largest valid
# bodies hold a few thousand (4,096 token-id prompts, or 1,024 chat messages of a few parts each).
MAX_CONTAINERS = 1 << 16
# A JSON string, so brackets inside texts are not counted: the unrolled form runs in linear time.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class OffLoopBodyRoute(APIRoute):
    """An APIRoute whose JSON body is bounded, decoded and validated against the route's body model in a worker
    thread; FastAPI then receives the validated model (which it passes through without validating again). Errors
    are FastAPI's own: a 422 RequestValidationError (`json_invalid`, or the model's errors under `body`)."""

    def get_route_handler(self) -> Handler:
        handle = super().get_route_handler()
        field = self.body_field
        if field is None:
            return handle

        async def decode_then_handle(request: Request) -> Response:
            raw = await request.body()
            if raw and _is_json(request.headers.get("content-type")):
                value = await asyncio.to_thread(_validated, field, raw)
                request = DecodedRequest(request, raw, value)
            return await handle(request)

        return decode_then_handle


class DecodedRequest(Request):
    """A request whose body was read and decoded already: `body()` and `json()` answer from memory."""

    def __init__(self, request: Request, raw: bytes, value: Any) -> None:
        super().__init__(request.scope, request.receive)
        self._raw, self._value = raw, value

    async def body(self) -> bytes:
        return self._raw

    async def json(self) -> Any:
        return self._value


def count_containers(raw: bytes) -> int:
    """The JSON arrays and objects in `raw`, brackets inside strings not counted (an upper bound for invalid JSON)."""
    count = raw.count(b"[") + raw.count(b"{")
    if count <= MAX_CONTAINERS:  # the common case: no need to look past strings
        return count
    bare = _JSON_STRING.sub(b'""', raw)
    return bare.count(b"[") + bare.count(b"{")


def _validated(field: Any, raw: bytes) -> Any:  # field: FastAPI's ModelField of the route's body
    if (num_containers := count_containers(raw)) > MAX_CONTAINERS:
        raise PayloadTooLargeError(f"request body holds {num_containers} JSON arrays and objects; a request holds "
                                   f"at most {MAX_CONTAINERS}")
    try:
        decoded = json.loads(raw)
    except json.JSONDecodeError as exc:  # as FastAPI words it
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": exc.msg}}], body=exc.doc) from None
    value, errors = field.validate(decoded, {}, loc=("body",))
    if errors:
        raise RequestValidationError(errors, body=decoded)
    return value


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI would decode a body of this content type as JSON (application/json or +json)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))
