"""Pieces of OpenAI-shaped responses shared by the completion and chat routes."""

from __future__ import annotations

from promptcache.pml import PromptPlan
from promptcache.server.generation import wire_prefix


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("stop" if reason == "abort" else reason)


def usage(final) -> dict:
    u = final.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def extension(final, plan: PromptPlan) -> dict:
    prefix = wire_prefix(final)
    return {"exact": bool(final.is_exact), "fidelity": final.fidelity, "positions": final.positions,
            "recomputed_tokens": final.usage.recomputed_tokens,
            "approximations": [] if final.is_exact else list(plan.approximations),
            "modules": [{"path": m.path, "num_tokens": m.num_tokens, "tier": m.tier,
                         "recomputed_tokens": m.num_recomputed} for m in final.modules or ()],
            "prefix": prefix.model_dump() if prefix is not None else None,
            "timings": {"ttft_ms": round(final.timings.ttft_ms, 3), "total_ms": round(final.timings.total_ms, 3),
                        "lookup_ms": round(final.timings.lookup_ms, 3)}}
