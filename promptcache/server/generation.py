"""Turning engine events into responses: sampling params from wire fields, collecting, SSE framing."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field

from starlette.requests import Request

from promptcache.model_runtime import CacheReport, ErrorKind, RequestReport, SamplingParams, TokenEvent
from promptcache.server import errors, wire
from promptcache.server.metrics import Metrics
from promptcache.server.tenants import tenant_label

DONE = "data: [DONE]\n\n"
SPAN_CONTEXT_TOKENS = 8  # tokens before a span decoded with it, so its text starts as in the whole prompt's
UNLIKELY_LOGPROB = -9999.0  # OpenAI's logprob of a token too unlikely to report; JSON has no -Infinity or NaN


def sampling_params(fields: wire.SamplingFields, max_tokens_limit: int, logprobs: int | None = None, *,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine's sampling parameters. `max_tokens` 0 (echo only) runs one token, which the caller drops."""
    if fields.max_tokens > max_tokens_limit:
        raise errors.UnsupportedParameterError(f"max_tokens is {fields.max_tokens}; this server allows at most "
                                               f"{max_tokens_limit}")
    return SamplingParams(max_tokens=max(fields.max_tokens, 1), temperature=fields.temperature, top_p=fields.top_p,
                          top_k=fields.top_k, min_p=fields.min_p, presence_penalty=fields.presence_penalty,
                          frequency_penalty=fields.frequency_penalty, repetition_penalty=fields.repetition_penalty,
                          logit_bias=_bias_by_token_id(fields.logit_bias or {}), n=fields.n, seed=fields.seed,
                          stop=(fields.stop,) if isinstance(fields.stop, str) else tuple(fields.stop or ()),
                          logprobs=logprobs, ignore_eos=fields.ignore_eos, prompt_logprobs=prompt_logprobs)


def _bias_by_token_id(logit_bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs. Raises errors.InvalidParameterError (a 400) when two keys name one token ("5" and "05"):
    which bias was meant is unknowable, and adding both would exceed the per-token bound."""
    keys: dict[int, str] = {}
    for key in logit_bias:
        token = int(key)
        if token in keys:
            raise errors.InvalidParameterError(f"logit_bias: keys {keys[token]!r} and {key!r} both name token "
                                               f"{token}; give each token id once")
        keys[token] = key
    return tuple((int(key), bias) for key, bias in logit_bias.items())


def raise_for_error(event: TokenEvent) -> None:
    if (report := event.report) is not None and report.error is not None:
        if report.error_type == ErrorKind.INVALID_REQUEST:
            raise errors.RequestRejectedError(report.error)
        raise errors.EngineFailureError(report.error)


@dataclass
class Outcome:
    """A finished request: per-sample text and finish reason, and the request's report."""

    texts: list[str]
    finish_reasons: list[str | None]
    report: RequestReport
    events: list[list[TokenEvent]] = field(default_factory=list)  # per sample, every token event


async def collect(events: AsyncIterator[TokenEvent], n: int) -> Outcome:
    texts = [""] * n
    reasons: list[str | None] = [None] * n
    per_sample: list[list[TokenEvent]] = [[] for _ in range(n)]
    report = None
    async for event in events:
        raise_for_error(event)
        texts[event.index] += event.text
        if event.token_id is not None:
            per_sample[event.index].append(event)
        if event.finish_reason is not None:
            reasons[event.index] = event.finish_reason
        report = event.report if event.report is not None else report
    assert report is not None, "the engine always ends a request with a report"
    return Outcome(texts, reasons, report, per_sample)


async def collect_all(request: Request, streams: Sequence[AsyncIterator[TokenEvent]], n: int) -> list[Outcome]:
    """Every stream `collect`ed, while watching the connection. Raises ClientDisconnectedError when the client goes
    away first: the collecting is cancelled, and a stream closed early aborts its request in the engine, which stops
    computing tokens no one will read."""
    gone: asyncio.Future[None] = asyncio.ensure_future(_disconnect(request))
    work: asyncio.Future[list[Outcome]] = asyncio.gather(*(collect(events, n) for events in streams))
    # Cancelled, gather() holds a CancelledError as its exception: read it, or asyncio logs it as never retrieved.
    work.add_done_callback(lambda done: done.cancelled() or done.exception())
    try:
        await asyncio.wait((gone, work), return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        work.cancel()
        await asyncio.wait({work})  # the streams closed: their aborts are posted
        raise errors.ClientDisconnectedError("the client disconnected before the response was ready")
    finally:
        gone.cancel()
        work.cancel()  # a no-op once done; this handler cancelled (shutdown) aborts the requests too


async def _disconnect(request: Request) -> None:
    """Returns once the client has disconnected. The route has read the body: what arrives next is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def wire_logprob(value: float) -> float:
    """A logprob as every route sends it, JSON or SSE: one that is not a finite number (-inf, a token the model rules
    out; NaN) is UNLIKELY_LOGPROB."""
    return value if math.isfinite(value) else UNLIKELY_LOGPROB


def wire_logprobs(events: list[TokenEvent], token_text: Callable[[int], str]) -> wire.Logprobs | None:
    """The logprobs of a sample's token events (None when the request asked for none)."""
    if not events or events[0].logprobs is None:
        return None
    result = wire.Logprobs()
    for event in events:
        assert event.logprobs is not None and event.token_id is not None
        result.tokens.append(token_text(event.token_id))
        result.token_ids.append(event.token_id)
        result.token_logprobs.append(wire_logprob(event.logprobs.logprob))
        result.top_logprobs.append({token_text(t): wire_logprob(lp) for t, lp in event.logprobs.top})
        result.top_token_ids.append([t for t, _ in event.logprobs.top])
        result.top_token_logprobs.append([wire_logprob(lp) for _, lp in event.logprobs.top])
    return result


def record(metrics: Metrics, report: RequestReport, finish_reasons: list[str | None], tenant: str | None) -> None:
    usage, timings, cache = report.usage, report.timings, report.cache
    assert usage is not None and timings is not None and cache is not None, "a served request reports all three"
    reused = [("module", m.tier, m.num_tokens) for m in cache.modules if m.tier not in (None, "computed")]
    if cache.prefix is not None:
        reused += [("prefix", tier, count) for tier, count in cache.prefix.tiers]
    metrics.observe(ttft_s=timings.ttft_ms / 1e3, e2e_s=timings.total_ms / 1e3, prompt_tokens=usage.prompt_tokens,
                    cached_tokens=usage.cached_tokens, completion_tokens=usage.completion_tokens,
                    finish_reasons=[r or "unknown" for r in finish_reasons], reused=reused, tenant=tenant_label(tenant))


def wire_report(report: RequestReport, detokenize: Callable[[list[int]], str] | None = None,
                ) -> tuple[wire.Usage, wire.CacheReport, wire.Timings]:
    """/v1/generate's usage, cache report and timings of a finished request. With `detokenize` the cache
    report lists the prompt's spans with their text, which decodes every prompt token: off the event loop."""
    usage, timings, cache = report.usage, report.timings, report.cache
    assert usage is not None and timings is not None and cache is not None, "a served request reports all three"
    spans = wire_spans(cache, detokenize) if detokenize is not None else None
    return (wire.Usage(**asdict(usage), total_tokens=usage.total_tokens),  # the engine's other counts stay off the wire
            to_wire(cache, spans), wire.Timings(**{name: round(ms, 3) for name, ms in asdict(timings).items()}))


def to_wire(report: CacheReport, spans: list[wire.PromptSpanReport] | None = None) -> wire.CacheReport:
    """A cache report's wire form (`cache`, the base of explain's and of `promptcache`); `spans` with their text."""
    prefix = report.prefix
    return wire.CacheReport(
        exact=report.is_exact, generation_prompt_added=report.generation_prompt_added, fidelity=report.fidelity,
        positions=report.positions, context=report.context, recomputed_tokens=report.num_recomputed,
        approximations=list(report.approximations), spans=spans,
        modules=[wire.ModuleReport(path=m.path, num_tokens=m.num_tokens, tier=m.tier,
                                   recomputed_tokens=m.num_recomputed, encoded_after=m.encoded_after)
                 for m in report.modules],
        prefix=None if prefix is None else wire.PrefixReport(num_tokens=prefix.num_tokens,
                                                             num_blocks=prefix.num_blocks, tiers=dict(prefix.tiers)))


def wire_spans(report: CacheReport, detokenize: Callable[[list[int]], str]) -> list[wire.PromptSpanReport]:
    """The report's prompt spans with their text (none if unreported); decodes every prompt token, so off the loop."""
    spans = report.spans or ()
    texts = span_texts([s.token_ids for s in spans], detokenize)
    return [wire.PromptSpanReport(start=s.start, num_tokens=s.num_tokens, origin=s.origin, module=s.module,
                                  tier=s.tier, text=text) for s, text in zip(spans, texts)]


def span_texts(runs: Sequence[Sequence[int]], detokenize: Callable[[list[int]], str]) -> list[str]:
    """The texts of consecutive token runs, joined equal to the runs decoded together: each run is decoded after the
    last few tokens before it and keeps what they did not make (a tokenizer may drop a leading space, or split a
    character's bytes across runs: the earlier text then gives up its incomplete tail)."""
    texts: list[str] = []
    before: list[int] = []
    for run in runs:
        context = before[-SPAN_CONTEXT_TOKENS:]
        head = detokenize(context) if context else ""
        whole = detokenize([*context, *run])
        keep = next((i for i, (a, b) in enumerate(zip(head, whole)) if a != b), min(len(head), len(whole)))
        if keep < len(head) and texts:  # the context's decoded tail changed (a split character)
            texts[-1] = texts[-1][: max(0, len(texts[-1]) - (len(head) - keep))]
        texts.append(whole[keep:])
        before += run
    return texts


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def sse_stream(payloads: AsyncIterator[dict]) -> AsyncIterator[str]:
    """The payloads as SSE events, then [DONE]; an error raised meanwhile (headers are sent) goes in-band."""
    try:
        async for payload in payloads:
            yield sse(payload)
    except Exception as exc:
        yield sse_error(exc)
    yield DONE


def sse_error(exc: Exception) -> str:
    """The in-band error event of a stream whose headers are sent: a 5xx carries an error id, not internals."""
    status, kind, message = errors.public_error(exc, "a stream")
    return sse({"error": {"type": kind, "message": message, "status": status}})
