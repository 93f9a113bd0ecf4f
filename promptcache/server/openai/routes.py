"""OpenAI-compatible API: /v1/completions, /v1/chat/completions (with PML module imports), /v1/models, and
vLLM's /tokenize and /detokenize. Logprobs are of the model's distribution (before temperature, top-k, top-p)."""

from __future__ import annotations

import asyncio
from typing import Any
from xml.sax.saxutils import escape

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from promptcache.pml import PromptPlan
from promptcache.server.errors import UnsupportedParameterError
from promptcache.server.generation import collect_all, raise_for_error, record, sampling_params, sse_stream
from promptcache.server.json_body import json_off_loop
from promptcache.server.openai import shapes, wire
from promptcache.server.request_body import OffLoopBodyRoute
from promptcache.server.service import PromptService, Rates, Service, Tenant

router = APIRouter(prefix="/v1", route_class=OffLoopBodyRoute)
tokenizer_router = APIRouter(route_class=OffLoopBodyRoute)  # vLLM's paths: no /v1


@router.get("/models")
async def models(service: Service) -> dict:
    return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0,
                                        "owned_by": "promptcache", "max_model_len": service.runtime.max_positions}]}


@router.post("/completions")
async def completions(body: wire.CompletionRequest, service: Service, tenant: Tenant, rates: Rates, request: Request):
    wire.refuse_unsupported(body)
    prompts = body.prompts()
    if not prompts or any(not p for p in prompts):
        raise UnsupportedParameterError("prompt: expected a non-empty text, list of texts, token ids or list of "
                                        "token-id lists")
    cap = service.settings.max_prompts_per_request
    if len(prompts) > cap:
        raise UnsupportedParameterError(f"prompt: {len(prompts)} prompts in one request; this server takes at most "
                                        f"{cap} (max_prompts_per_request)")
    rates.check(tenant, len(prompts) * body.n, already_counted=1)
    # Parsing, tokenizing and detokenizing run off the event loop (a long prompt must not stall other clients).
    plans, echoes, prompt_ids = await asyncio.to_thread(_prepare, service, body, prompts, tenant)
    if len(plans) == 1 and not body.echo:
        return await _run(service, body, plans[0], tenant, request)
    return await _run_many(service, body, plans, echoes, prompt_ids, tenant, request)


def _prepare(service: PromptService, body: wire.CompletionRequest, prompts: list[str | list[int]],
             tenant: str | None) -> tuple[list[PromptPlan], list[str] | None, list[list[int]] | None]:
    """Each prompt's plan (token ids as given; a PML document, starting `<prompt`, imports modules; other text is plain,
    never XML), with echo its text, with echo and logprobs its token ids (they get logprobs too)."""
    plans = [service.runtime.plan_tokens(p) if not isinstance(p, str) else service.plan(p, tenant=tenant)
             if wire.is_pml(p) else service.runtime.plan_text(p) for p in prompts]
    echoes = [p if isinstance(p, str) else service.runtime.detokenize(p) for p in prompts] if body.echo else None
    prompt_ids = ([list(p) if not isinstance(p, str) else list(service.runtime.tokenize(p)) for p in prompts]
                  if body.echo and body.logprobs is not None else None)
    return plans, echoes, prompt_ids


@router.post("/chat/completions")
async def chat_completions(body: wire.ChatCompletionRequest, service: Service, tenant: Tenant, rates: Rates,
                           request: Request):
    wire.refuse_unsupported(body)
    rates.check(tenant, body.n, already_counted=1)
    if body.max_completion_tokens is not None:
        body.max_tokens = body.max_completion_tokens
    elif "max_tokens" not in body.model_fields_set:
        body.max_tokens = min(256, service.settings.max_tokens_limit)
    messages = wire.chat_messages(body.messages)
    if schema_name := body.schema_name:
        plan = await asyncio.to_thread(lambda: service.plan(_chat_pml(schema_name, messages), tenant=tenant))
    else:
        plan = await asyncio.to_thread(service.runtime.plan_chat, messages)
    return await _run(service, body, plan, tenant, request)


def _chat_pml(schema: str, messages: list[dict[str, str]]) -> str:
    """With a schema, message contents are PML (so `<module-name/>` imports modules). The schema's layout comes
    first and has no free positions before its modules, so leading system messages become a system turn right
    after the first other message (which imports the modules), where new text always fits (docs/api.md)."""
    leading = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if 0 < leading < len(messages):
        messages = [messages[leading], *messages[:leading], *messages[leading + 1:]]
    turns = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
    return f'<prompt schema="{escape(schema, {chr(34): "&quot;"})}" xml:space="preserve">{turns}<assistant/></prompt>'


async def _run(service: PromptService, body: wire.ChatCompletionRequest | wire.CompletionRequest, plan: PromptPlan,
               tenant: str | None, request: Request):
    chat = isinstance(body, wire.ChatCompletionRequest)
    # The alternatives each token's logprobs carry; None: the request wants no logprobs.
    num_logprobs = (body.logprobs if isinstance(body, wire.CompletionRequest)
                    else (body.top_logprobs or 0) if body.logprobs else None)
    params = sampling_params(body, service.settings.max_tokens_limit, num_logprobs)
    head = shapes.response_head(service.model_name, chat=chat)
    events = service.submit(plan, params, body.cache_salt, head["id"], service.fidelity(body.fidelity, body), tenant)
    if params.logprobs is not None:  # streamed tokens are looked up on the event loop: the table must be there
        await service.token_strings.ready()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(sse_stream(_chunks(service, events, head, chat, include_usage, tenant)),
                                 media_type="text/event-stream")
    [outcome] = await collect_all(request, [events], params.n)  # a client gone: aborted
    record(service.metrics, outcome.report, outcome.finish_reasons, tenant)
    token_text = service.token_strings.text

    def answer() -> dict:
        choices = [{"index": i, "finish_reason": shapes.finish_reason(reason), "logprobs": None
                    if params.logprobs is None else shapes.logprobs(outcome.events[i], token_text, chat),
                    **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
                   for i, (text, reason) in enumerate(zip(outcome.texts, outcome.finish_reasons))]
        return {**head, "choices": choices, "usage": shapes.report_usage(outcome.report),
                "promptcache": shapes.extension(outcome.report)}

    # Every token's logprobs (n samples, 20 alternatives each) are assembled off the event loop.
    return await json_off_loop(answer) if params.logprobs is not None else answer()


async def _chunks(service: PromptService, events, head: dict, chat: bool, include_usage: bool, tenant: str | None):
    obj = head["object"] + (".chunk" if chat else "")
    started: set[int] = set()
    reasons: dict[int, str | None] = {}
    offsets: dict[int, int] = {}  # per sample: characters of token text sent so far (completions' text_offset)
    token_text = service.token_strings.text
    async for event in events:
        raise_for_error(event)
        logprobs = None
        if event.logprobs is not None and event.token_id is not None:
            offset = offsets.get(event.index, 0)
            logprobs = shapes.logprobs([event], token_text, chat, offset)
            offsets[event.index] = offset + len(token_text(event.token_id))
        choice: dict = {"index": event.index, "finish_reason": shapes.finish_reason(event.finish_reason),
                        "logprobs": logprobs}
        if chat:
            choice["delta"] = {"content": event.text}
            if event.index not in started:
                choice["delta"]["role"] = "assistant"
                started.add(event.index)
        else:
            choice["text"] = event.text
        if event.finish_reason is not None:
            reasons[event.index] = event.finish_reason
        yield {**head, "object": obj, "choices": [choice]}
        if event.report is not None:
            record(service.metrics, event.report, list(reasons.values()), tenant)
            if include_usage:
                yield {**head, "object": obj, "choices": [], "usage": shapes.report_usage(event.report),
                       "promptcache": shapes.extension(event.report)}


async def _run_many(service: PromptService, body: wire.CompletionRequest, plans: list[PromptPlan],
                    echoes: list[str] | None, prompt_ids: list[list[int]] | None, tenant: str | None,
                    request: Request) -> Response:
    """Several prompts, or echo (not streamed): prompt p's n choices from index p x n, all submitted at once (all queued
    or a 429) so shared text shares its KV; none run for `max_tokens` 0 without logprobs. `echoes`: texts to prepend;
    `prompt_ids` (echo with logprobs): the prompts' tokens get logprobs too, the first None as OpenAI reports it."""
    head = shapes.response_head(service.model_name, chat=False)
    outcomes: list = [None] * len(plans)
    if body.max_tokens > 0 or prompt_ids is not None:
        params = sampling_params(body, service.settings.max_tokens_limit, body.logprobs,
                                 prompt_logprobs=body.logprobs if prompt_ids is not None else None)
        streams = service.submit_many(plans, params, body.cache_salt, [f"{head['id']}-{i}" for i in range(len(plans))],
                                      service.fidelity(body.fidelity, body), tenant)
        outcomes = list(await collect_all(request, streams, params.n))
        for outcome in outcomes:
            record(service.metrics, outcome.report, outcome.finish_reasons, tenant)
    return await json_off_loop(lambda: {**head, **_answer(service, body, plans, outcomes, echoes, prompt_ids)})


def _answer(service: PromptService, body: wire.CompletionRequest, plans: list[PromptPlan], outcomes: list,
            echoes: list[str] | None, prompt_ids: list[list[int]] | None) -> dict:
    """Choices, usage and reports of the prompts (outcome None: not run); echoed logprobs built once per prompt."""
    choices: list[dict[str, Any]] = []
    reports: list[dict[str, Any]] = []
    totals = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    token_text = service.token_strings.text
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
        reports.append(shapes.extension(outcome.report))
        prompt_lps = outcome.report.prompt_logprobs or ()  # prompt_ids: echo with logprobs
        echoed = shapes.prompt_logprobs(prompt_ids[p], prompt_lps, token_text) if prompt_ids is not None else None
        for i, (text, reason) in enumerate(zip(outcome.texts, outcome.finish_reasons)):
            logprobs = None
            if body.logprobs is not None:
                logprobs = shapes.completion_logprobs(outcome.events[i] if generated else [], token_text)
                if echoed is not None:
                    logprobs = shapes.echoed_logprobs(echoed, logprobs)
            choices.append({"index": p * body.n + i, "text": echo + (text if generated else ""),
                            "finish_reason": shapes.finish_reason(reason) if generated else "length",
                            "logprobs": logprobs})
    return {"choices": choices, "usage": shapes.usage(**totals), "promptcache": {"prompts": reports}}


@tokenizer_router.post("/tokenize")
async def tokenize(body: wire.TokenizeRequest, service: Service) -> Response:
    """The token ids the completion routes would feed the model (vLLM's shape)."""
    if (body.prompt is None) == (body.messages is None):
        raise UnsupportedParameterError("send exactly one of prompt or messages")
    if not body.add_special_tokens:
        raise UnsupportedParameterError("add_special_tokens=false is not supported: prompts are tokenized as "
                                        "/v1/completions tokenizes them")
    if not body.add_generation_prompt:
        raise UnsupportedParameterError("add_generation_prompt=false is not supported: chats are rendered as "
                                        "/v1/chat/completions renders them")
    messages = wire.chat_messages(body.messages) if body.messages is not None else None

    def reply() -> dict:  # tokenizing and each token's string: per-token work, in a worker thread
        tokens = service.runtime.tokenize(body.prompt, messages)
        strings = {"token_strs": [service.token_strings.text(t) for t in tokens]} if body.return_token_strs else {}
        return {"count": len(tokens), "max_model_len": service.runtime.max_positions, "tokens": list(tokens), **strings}

    return await json_off_loop(reply)


@tokenizer_router.post("/detokenize")
async def detokenize(body: wire.DetokenizeRequest, service: Service) -> dict:
    return {"prompt": await asyncio.to_thread(service.runtime.detokenize, body.tokens)}
