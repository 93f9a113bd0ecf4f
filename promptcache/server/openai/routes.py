"""OpenAI-compatible API: /v1/completions, /v1/chat/completions (with PML module imports), /v1/models."""

from __future__ import annotations

import asyncio
from xml.sax.saxutils import escape

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from promptcache.pml import PromptPlan
from promptcache.server.errors import UnsupportedParameterError
from promptcache.server.generation import (
    DONE,
    collect,
    raise_for_error,
    record,
    sampling_params,
    sse,
    sse_error,
)
from promptcache.server.json_body import json_off_loop
from promptcache.server.openai.batch import extension, finish_reason, report_usage, response_head, run_completions
from promptcache.server.openai.logprobs import chat_logprobs, completion_logprobs
from promptcache.server.openai.wire import (
    ChatCompletionRequest,
    CompletionRequest,
    _OpenAIFields,
    chat_messages,
    is_pml,
    refuse_unsupported,
)
from promptcache.server.service import PromptService
from promptcache.server.state import Rates, Service, Tenant

router = APIRouter(prefix="/v1")


@router.get("/models")
async def models(service: Service) -> dict:
    return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0,
                                        "owned_by": "promptcache", "max_model_len": service.runtime.max_positions}]}


@router.post("/completions")
async def completions(body: CompletionRequest, service: Service, tenant: Tenant, rates: Rates):
    refuse_unsupported(body)
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
        return await _run(service, body, plans[0], tenant)
    return await run_completions(service, body, plans, echoes, prompt_ids, tenant)


def _prepare(service: PromptService, body: CompletionRequest, prompts: list[str | list[int]],
             tenant: str | None) -> tuple[list[PromptPlan], list[str] | None, list[list[int]] | None]:
    """Each prompt's plan; with echo its text; with echo and logprobs its token ids (they get logprobs too)."""
    plans = [_completion_plan(service, p, tenant) for p in prompts]
    echoes = [p if isinstance(p, str) else service.runtime.detokenize(p) for p in prompts] if body.echo else None
    prompt_ids = None
    if body.echo and body.logprobs is not None:
        prompt_ids = [list(p) if not isinstance(p, str) else list(service.runtime.tokenize(p)) for p in prompts]
    return plans, echoes, prompt_ids


def _completion_plan(service: PromptService, prompt: str | list[int], tenant: str | None) -> PromptPlan:
    """Token ids as given; a PML document (it starts with `<prompt`) imports modules; any other text is
    plain, tokenized verbatim (never XML)."""
    if not isinstance(prompt, str):
        return service.runtime.plan_tokens(prompt)
    return service.plan(prompt, tenant=tenant) if is_pml(prompt) else service.runtime.plan_text(prompt)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, service: Service, tenant: Tenant, rates: Rates):
    refuse_unsupported(body)
    rates.check(tenant, body.n, already_counted=1)
    if body.max_completion_tokens is not None:
        body.max_tokens = body.max_completion_tokens
    elif "max_tokens" not in body.model_fields_set:
        body.max_tokens = min(256, service.settings.max_tokens_limit)
    messages = chat_messages(body.messages)
    if schema_name := body.schema_name:
        plan = await asyncio.to_thread(lambda: service.plan(_chat_pml(schema_name, messages), tenant=tenant))
    else:
        plan = await asyncio.to_thread(service.runtime.plan_chat, messages)
    return await _run(service, body, plan, tenant)


def _chat_pml(schema: str, messages: list[dict[str, str]]) -> str:
    """With a schema, message contents are PML (so `<module-name/>` imports modules).

    The schema's layout comes first and has no free positions before its modules, so leading system
    messages become a system turn right after the first other message (which imports the modules),
    where new text always fits. The order is documented in docs/api.md.
    """
    leading = 0
    while leading < len(messages) and messages[leading]["role"] == "system":
        leading += 1
    if 0 < leading < len(messages):
        messages = [messages[leading], *messages[:leading], *messages[leading + 1:]]
    turns = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
    return f'<prompt schema="{escape(schema, {chr(34): "&quot;"})}" xml:space="preserve">{turns}<assistant/></prompt>'


async def _run(service: PromptService, body: _OpenAIFields, plan: PromptPlan, tenant: str | None):
    # The alternatives each token's logprobs carry; None: the request wants no logprobs.
    if isinstance(body, ChatCompletionRequest):
        chat, num_logprobs = True, (body.top_logprobs or 0) if body.logprobs else None
    else:
        assert isinstance(body, CompletionRequest)
        chat, num_logprobs = False, body.logprobs
    params = sampling_params(body, service.settings.max_tokens_limit, num_logprobs)
    head = response_head(service, chat=chat)
    events = service.submit(plan, params, body.cache_salt, head["id"], service.fidelity(body.fidelity, body), tenant)
    if params.logprobs is not None:  # streamed tokens are looked up on the event loop: the table must be there
        await service.token_strings.ready()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(service, events, head, chat, include_usage, tenant),
                                 media_type="text/event-stream")
    outcome = await collect(events, params.n)
    record(service.metrics, outcome.report, outcome.finish_reasons, tenant)

    def answer() -> dict:
        choices = []
        for index, (text, reason) in enumerate(zip(outcome.texts, outcome.finish_reasons)):
            choice = {"index": index, "finish_reason": finish_reason(reason),
                      "logprobs": _logprobs(outcome.events[index], service, chat) if params.logprobs is not None
                      else None}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            choices.append(choice)
        return {**head, "choices": choices, "usage": report_usage(outcome.report),
                "promptcache": extension(outcome.report)}

    # Every token's logprobs (n samples, 20 alternatives each) are assembled off the event loop.
    return await json_off_loop(answer) if params.logprobs is not None else answer()


async def _stream(service, events, head: dict, chat: bool, include_usage: bool, tenant: str | None):
    obj = head["object"] + (".chunk" if chat else "")
    started: set[int] = set()
    reasons: dict[int, str | None] = {}
    offsets: dict[int, int] = {}  # per sample: characters of token text sent so far (completions' text_offset)
    try:
        async for event in events:
            raise_for_error(event)
            logprobs = None
            if event.logprobs is not None and event.token_id is not None:
                logprobs = _logprobs([event], service, chat, offsets.get(event.index, 0))
                offsets[event.index] = offsets.get(event.index, 0) + len(service.token_strings.text(event.token_id))
            choice: dict = {"index": event.index, "finish_reason": finish_reason(event.finish_reason),
                            "logprobs": logprobs}
            if chat:
                delta = {"content": event.text}
                if event.index not in started:
                    delta["role"] = "assistant"
                    started.add(event.index)
                choice["delta"] = delta
            else:
                choice["text"] = event.text
            if event.finish_reason is not None:
                reasons[event.index] = event.finish_reason
            yield sse({**head, "object": obj, "choices": [choice]})
            if event.report is not None:
                record(service.metrics, event.report, list(reasons.values()), tenant)
                if include_usage:
                    yield sse({**head, "object": obj, "choices": [], "usage": report_usage(event.report),
                               "promptcache": extension(event.report)})
    except Exception as exc:
        yield sse_error(exc)
    yield DONE


def _logprobs(events: list, service: PromptService, chat: bool, text_offset: int = 0) -> dict:
    if chat:
        return chat_logprobs(events, service.token_strings.text)
    return completion_logprobs(events, service.token_strings.text, text_offset=text_offset)
