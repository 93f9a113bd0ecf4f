"""Pieces of OpenAI-shaped responses shared by the completion and chat routes."""

from __future__ import annotations

from promptcache.model_runtime import TokenEvent, served_report
from promptcache.pml import PromptPlan
from promptcache.server.generation import to_wire


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("stop" if reason == "abort" else reason)


def usage(final: TokenEvent) -> dict:
    u = final.usage
    assert u is not None, "a final event carries usage"
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def extension(final: TokenEvent, plan: PromptPlan) -> dict:
    """The `promptcache` object of OpenAI-shaped responses: /v1/generate's `cache` report, every field
    (one `to_wire`), plus the timings."""
    assert final.timings is not None, "a final event carries timings"
    report = to_wire(served_report(final, plan)).model_dump()
    report["timings"] = {"ttft_ms": round(final.timings.ttft_ms, 3), "total_ms": round(final.timings.total_ms, 3),
                         "lookup_ms": round(final.timings.lookup_ms, 3)}
    return report
