"""/v1/completions with several prompts or with echo (not streamed): each prompt is one group of n
choices (choice index = prompt index x n + sample), all submitted to the engine at once, so prompts that
share text share its KV through the block index; one answer with every choice and the summed usage.
The prompt count is capped by the route (`max_prompts_per_request`), so "all at once" is bounded.

Also the pieces of OpenAI-shaped responses the completion and chat routes share."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi.responses import Response

from promptcache.model_runtime import RequestReport
from promptcache.pml import PromptPlan
from promptcache.server.generation import Outcome, collect, record, sampling_params, to_wire
from promptcache.server.json_body import json_off_loop
from promptcache.server.openai.logprobs import completion_logprobs, echoed_logprobs, prompt_logprobs
from promptcache.server.openai.wire import CompletionRequest
from promptcache.server.service import PromptService


async def run_completions(service: PromptService, body: CompletionRequest, plans: list[PromptPlan],
                          echoes: list[str] | None, prompt_ids: list[list[int]] | None = None,
                          tenant: str | None = None) -> Response:
    """Run every plan (none when `max_tokens` is 0 and no logprobs are asked: echo only). `echoes` are the
    prompts' texts to prepend; with `prompt_ids` (echo with logprobs) the prompts' tokens get logprobs
    too, the first one None (nothing precedes it), as OpenAI reports them. The answer is assembled and
    rendered off the event loop."""
    head = response_head(service, chat=False)
    outcomes: list[Outcome | None] = [None] * len(plans)
    if body.max_tokens > 0 or prompt_ids is not None:
        params = sampling_params(body, service.settings.max_tokens_limit, body.logprobs,
                                 prompt_logprobs=body.logprobs if prompt_ids is not None else None)
        fidelity = service.fidelity(body.fidelity, body)
        streams = service.submit_many(plans, params, body.cache_salt,  # all queued, or a 429 and none
                                      [f"{head['id']}-{i}" for i in range(len(plans))], fidelity, tenant)
        outcomes = list(await asyncio.gather(*(collect(events, params.n) for events in streams)))
    for outcome in outcomes:
        if outcome is not None:
            record(service.metrics, outcome.report, outcome.finish_reasons, tenant)
    return await json_off_loop(lambda: {**head, **_answer(service, body, plans, outcomes, echoes, prompt_ids)})


def _answer(service: PromptService, body: CompletionRequest, plans: list[PromptPlan],
            outcomes: list[Outcome | None], echoes: list[str] | None,
            prompt_ids: list[list[int]] | None) -> dict:
    """Choices, usage and reports of finished prompts. Per-token work (each token's text and its top
    alternatives') reads the token-string table; an echoed prompt's part is built once for its n samples."""
    choices: list[dict[str, Any]] = []
    reports: list[dict[str, Any]] = []
    totals = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    for p, (plan, outcome) in enumerate(zip(plans, outcomes)):
        echo = echoes[p] if echoes is not None else ""
        if outcome is None:
            totals["prompt_tokens"] += plan.num_cached_tokens + plan.num_new_tokens
            choices += [{"index": p * body.n + i, "text": echo, "finish_reason": "length", "logprobs": None}
                        for i in range(body.n)]
            continue
        used = outcome.report.usage
        assert used is not None, "a served request reports usage"
        generated = body.max_tokens > 0  # else the engine ran one token for the prompt's logprobs: dropped
        totals["prompt_tokens"] += used.prompt_tokens
        totals["completion_tokens"] += used.completion_tokens if generated else 0
        totals["cached_tokens"] += used.cached_tokens
        reports.append(extension(outcome.report))
        echoed = None
        if body.logprobs is not None and prompt_ids is not None:
            echoed = prompt_logprobs(prompt_ids[p], outcome.report.prompt_logprobs or (), service.token_strings.text)
        for i, (text, reason) in enumerate(zip(outcome.texts, outcome.finish_reasons)):
            events = outcome.events[i] if generated else []
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(events, service.token_strings.text)
                if echoed is not None:
                    logprobs = echoed_logprobs(echoed, logprobs)
            choices.append({"index": p * body.n + i, "text": echo + (text if generated else ""),
                            "finish_reason": finish_reason(reason) if generated else "length",
                            "logprobs": logprobs})
    return {"choices": choices, "usage": usage(**totals), "promptcache": {"prompts": reports}}


def response_head(service: PromptService, *, chat: bool) -> dict:
    """What an OpenAI response and each of its chunks start with: a new id, the object, the time, the model."""
    prefix, obj = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
    return {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "object": obj, "created": int(time.time()),
            "model": service.model_name}


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("stop" if reason == "abort" else reason)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def report_usage(report: RequestReport) -> dict:
    u = report.usage
    assert u is not None, "a served request reports usage"
    return usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)


def extension(report: RequestReport) -> dict:
    """The `promptcache` object of OpenAI-shaped responses: /v1/generate's `cache` report, every field
    (one `to_wire`), plus the timings."""
    timings = report.timings
    assert timings is not None and report.cache is not None, "a served request reports timings and its cache"
    wire = to_wire(report.cache).model_dump()
    wire["timings"] = {"ttft_ms": round(timings.ttft_ms, 3), "total_ms": round(timings.total_ms, 3),
                       "lookup_ms": round(timings.lookup_ms, 3)}
    return wire
