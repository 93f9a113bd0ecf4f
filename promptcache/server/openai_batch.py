"""/v1/completions with several prompts or with echo (not streamed): each prompt is one group of n
choices (choice index = prompt index x n + sample), all submitted to the engine at once, so prompts that
share text share its KV through the block index; one answer with every choice and the summed usage."""

from __future__ import annotations

import asyncio
import time
import uuid

from promptcache.pml import PromptPlan
from promptcache.server.generation import Outcome, collect, record, sampling_params
from promptcache.server.openai_logprobs import completion_logprobs
from promptcache.server.openai_shapes import extension, finish_reason
from promptcache.server.openai_wire import CompletionRequest
from promptcache.server.service import PromptService


async def run_completions(service: PromptService, body: CompletionRequest, plans: list[PromptPlan],
                          echoes: list[str] | None) -> dict:
    """Run every plan (none when `max_tokens` is 0: echo only); `echoes` are the prompts' texts to prepend."""
    request_id = f"cmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    outcomes: list[Outcome | None] = [None] * len(plans)
    if body.max_tokens > 0:
        params = sampling_params(body, service.settings.max_tokens_limit, body.logprobs)
        fidelity = service.fidelity(body.fidelity, body.fidelity_head_tokens)
        outcomes = list(await asyncio.gather(*(
            collect(service.submit(plan, params, body.cache_salt, f"{request_id}-{i}", fidelity), params.n)
            for i, plan in enumerate(plans))))
    choices, reports = [], []
    totals = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    for p, (plan, outcome) in enumerate(zip(plans, outcomes)):
        echo = echoes[p] if echoes is not None else ""
        if outcome is None:
            totals["prompt_tokens"] += plan.num_cached_tokens + plan.num_new_tokens
            choices += [{"index": p * body.n + i, "text": echo, "finish_reason": "length", "logprobs": None}
                        for i in range(body.n)]
            continue
        record(service.metrics, outcome.final, outcome.finish_reasons)
        used = outcome.final.usage
        totals["prompt_tokens"] += used.prompt_tokens
        totals["completion_tokens"] += used.completion_tokens
        totals["cached_tokens"] += used.cached_tokens
        reports.append(extension(outcome.final, plan))
        for i, (text, reason) in enumerate(zip(outcome.texts, outcome.finish_reasons)):
            logprobs = completion_logprobs(outcome.events[i], service.token_text) \
                if body.logprobs is not None else None
            choices.append({"index": p * body.n + i, "text": echo + text, "finish_reason": finish_reason(reason),
                            "logprobs": logprobs})
    usage = {"prompt_tokens": totals["prompt_tokens"], "completion_tokens": totals["completion_tokens"],
             "total_tokens": totals["prompt_tokens"] + totals["completion_tokens"],
             "prompt_tokens_details": {"cached_tokens": totals["cached_tokens"]}}
    return {"id": request_id, "object": "text_completion", "created": created, "model": service.model_name,
            "choices": choices, "usage": usage, "promptcache": {"prompts": reports}}
