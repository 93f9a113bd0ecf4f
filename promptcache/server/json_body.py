"""JSON response bodies built and encoded in a worker thread, a slice at a time: one `json.dumps` or pydantic call over
megabytes of logprobs would hold the GIL throughout, and the event loop could answer no one meanwhile. The bytes are
those FastAPI renders for the value a route returns."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from typing import Any

from fastapi.encoders import jsonable_encoder
from fastapi.responses import Response
from pydantic import BaseModel

SLICE_ITEMS = 256  # list items per json.dumps call
# As JSONResponse renders; `default` converts what jsonable_encoder would (enums, models, dataclasses).
_dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":"),
                           default=jsonable_encoder)


async def json_off_loop(build: Callable[[], Any]) -> Response:
    """The JSON response of `build()`, built and encoded in a worker thread: a pydantic model as pydantic serializes it,
    its `choices` one at a time; anything else as JSONResponse encodes it."""

    def render() -> Response:
        value = build()
        body = model_body(value, "choices") if isinstance(value, BaseModel) else json_body(value)
        return Response(body, media_type="application/json")

    return await asyncio.to_thread(render)


def json_body(value: Any) -> bytes:
    """`value` as JSONResponse encodes it, with every list encoded SLICE_ITEMS items (or one nested item) per call."""
    pieces: list[str] = []
    _encode(value, pieces)
    return "".join(pieces).encode("utf-8")


def model_body(model: BaseModel, field: str) -> bytes:
    """`model` as pydantic serializes it (`model_dump_json(by_alias=True)`), its list `field` serialized one
    item per call and spliced in: an unescaped `"<field>":[]` cannot occur inside a JSON string."""
    items = getattr(model, field)
    head = model.model_copy(update={field: []}).model_dump_json(by_alias=True)
    empty = f'"{field}":[]'
    assert head.count(empty) >= 1, f"{type(model).__name__} serializes {field} as {empty} when empty"
    inner = ",".join(item.model_dump_json(by_alias=True) for item in items)
    return head.replace(empty, f'"{field}":[{inner}]', 1).encode("utf-8")


def _encode(value: Any, pieces: list[str]) -> None:
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        pieces.append("{")
        for i, (key, item) in enumerate(value.items()):
            pieces.append(("," if i else "") + _dumps(key) + ":")
            _encode(item, pieces)
        pieces.append("}")
    elif isinstance(value, (list, tuple)) and _has_nested(value):
        pieces.append("[")
        for i, item in enumerate(value):
            pieces.append("," if i else "")
            _encode(item, pieces)
        pieces.append("]")
    elif isinstance(value, (list, tuple)) and len(value) > SLICE_ITEMS:
        pieces.append("[" + ",".join(_dumps(value[i:i + SLICE_ITEMS])[1:-1]
                                     for i in range(0, len(value), SLICE_ITEMS)) + "]")
    else:
        pieces.append(_dumps(value))


def _has_nested(items: list | tuple) -> bool:
    """Whether the items nest lists or dicts (a token's alternatives are flat); the first non-null speaks for all."""
    first = next((item for item in items if item is not None), None)
    if isinstance(first, dict):
        return any(isinstance(v, (dict, list, tuple)) for v in first.values())
    return isinstance(first, (list, tuple))
