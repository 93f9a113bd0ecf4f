"""Pieces of OpenAI-shaped responses shared by the completion and chat routes."""

from __future__ import annotations

from promptcache.model_runtime import RequestReport
from promptcache.server.generation import to_wire


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("stop" if reason == "abort" else reason)


def usage(report: RequestReport) -> dict:
    u = report.usage
    assert u is not None, "a served request reports usage"
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def extension(report: RequestReport) -> dict:
    """The `promptcache` object of OpenAI-shaped responses: /v1/generate's `cache` report, every field
    (one `to_wire`), plus the timings."""
    timings = report.timings
    assert timings is not None and report.cache is not None, "a served request reports timings and its cache"
    wire = to_wire(report.cache).model_dump()
    wire["timings"] = {"ttft_ms": round(timings.ttft_ms, 3), "total_ms": round(timings.total_ms, 3),
                       "lookup_ms": round(timings.lookup_ms, 3)}
    return wire
