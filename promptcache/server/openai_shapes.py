"""Pieces of OpenAI-shaped responses shared by the completion and chat routes."""

from __future__ import annotations

from promptcache.pml import PromptPlan
from promptcache.server.generation import wire_cache


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("stop" if reason == "abort" else reason)


def usage(final) -> dict:
    u = final.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def extension(final, plan: PromptPlan) -> dict:
    """The `promptcache` object of OpenAI-shaped responses: /v1/generate's `cache` report (exact, fidelity,
    positions, context, recomputed tokens, modules with `encoded_after`, prefix) plus the timings."""
    report = wire_cache(final, plan.approximations, generation_prompt_added=plan.generation_prompt_added).model_dump()
    report["timings"] = {"ttft_ms": round(final.timings.ttft_ms, 3), "total_ms": round(final.timings.total_ms, 3),
                         "lookup_ms": round(final.timings.lookup_ms, 3)}
    return report
