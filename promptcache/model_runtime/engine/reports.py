"""The events that end a request: its final report, or its failure."""

from __future__ import annotations

import bisect
import logging
import time
import uuid

from promptcache.cache_store import Link
from promptcache.model_runtime.engine.request import ErrorKind, FinishReason, Request, RequestReport, TokenEvent
from promptcache.model_runtime.engine.reuse_plan import ReusePlan
from promptcache.model_runtime.errors import InvalidRequestError
from promptcache.model_runtime.results import PromptSpan, Timings, Usage, served_report
from promptcache.model_runtime.sampling import TokenLogprobs
from promptcache.pml import NewRun, PromptPlan

logger = logging.getLogger(__name__)


def final_event(request: Request, index: int, token: int | None, text: str, finish: FinishReason,
                logprobs: TokenLogprobs | None = None) -> TokenEvent:
    """The request's last event, with its report: usage, timings and the cache report."""
    plan, reuse, stream = request.plan, request.reuse, request.stream
    now = time.perf_counter()
    from_prefix = stream.num_reused if stream is not None else 0
    reused = from_prefix + (sum(u.last - u.first for u in reuse.uses) if reuse is not None else 0)
    # Recomputed by this request: stream tokens reused from the prefix index were recomputed by the one
    # that stored them, and count as cached here.
    recomputed = sum(n for _, n in reuse.recomputed_from(from_prefix)) if reuse is not None else 0
    usage = Usage(plan.num_prompt_tokens, cached_tokens=reused, computed_tokens=request.num_computed_tokens,
                  completion_tokens=sum(len(s.output_ids) for s in request.sequences), recomputed_tokens=recomputed)
    first = request.first_token_at or now
    timings = Timings(encode_ms=request.encode_ms, assembly_ms=request.assembly_ms, lookup_ms=request.lookup_ms,
                      prefill_ms=request.prefill_ms, ttft_ms=(first - request.submitted_at) * 1e3,
                      total_ms=(now - request.submitted_at) * 1e3)
    prompt_logprobs = tuple(request.prompt_logprobs) if request.prompt_logprobs is not None else None
    spans = prompt_spans(plan, reuse, request.use_tiers, stream.match.links) \
        if request.report_spans and reuse is not None and stream is not None else None
    cache = served_report(plan, reuse, request.fidelity.mode, usage, request.modules,
                          [(link.tier, link.num_tokens) for link in stream.match.links] if stream is not None else (),
                          spans)
    return TokenEvent(request.request_id, index, token, text, finish, logprobs,
                      RequestReport(usage, timings, cache, prompt_logprobs))


def prompt_spans(plan: PromptPlan, reuse: ReusePlan, use_tiers: tuple[str, ...],
                 links: tuple[Link, ...]) -> tuple[PromptSpan, ...] | None:
    """Every prompt token once, in position order, as spans by where its KV came from: `reuse.uses` (from `use_tiers`),
    prefix `links`, or the stream. None (and a warning) if the stream misses the plan (a bug)."""
    # Runs of the prompt: (start position, token ids, owner, tier of reused module KV or None for the
    # stream, is module KV). The stream is every prompt token no use covers, in position order, in every
    # fidelity mode (exact mode renumbers its positions but keeps this order): a token's stream index is
    # its rank among those. A cached segment leaves its head (before `first`: balanced) and its tail
    # (from `last`: the last token recomputed for its logits) to the stream.
    runs: list[tuple[int, tuple[int, ...], str | None, str | None, bool]] = []
    reused: dict[int, tuple[int, int]] = {}  # segment id -> [first, last) of its KV reused
    for use, use_tier in zip(reuse.uses, use_tiers):
        segment = use.cached.segment
        reused[segment.segment_id] = (use.first, use.last)
        runs.append((segment.start + use.first, segment.token_ids[use.first: use.last], segment.owner, use_tier, True))
    for cached in plan.cached:
        segment = cached.segment
        first, last = reused.get(segment.segment_id, (0, 0))
        runs.append((segment.start, segment.token_ids[:first], segment.owner, None, True))
        runs.append((segment.start + last, segment.token_ids[last:], segment.owner, None, True))
    runs += [(run.start, run.token_ids, _run_module(plan, run), None, False) for run in plan.new_runs]
    runs = sorted((r for r in runs if r[1]), key=lambda r: r[0])
    pieces: list[tuple[int, tuple[int, ...], str, str | None, str | None]] = []
    reused_runs = _tier_runs(links)
    ends = [end for _, end, _ in reused_runs]
    at = 0  # stream index of the next stream token
    for start, token_ids, owner, tier, is_module_kv in runs:
        if tier is not None:
            pieces.append((start, token_ids, "module", owner or None, tier))
            continue
        # A module's stream run recomputes its first tokens (its head), or none (text, the last token).
        num_recomputed = sum(o is not None for o in reuse.recomputes[at: at + len(token_ids)]) if is_module_kv else 0
        for offset, count, block_tier in _pieces(at, len(token_ids), num_recomputed, reused_runs, ends):
            origin = "prefix" if block_tier is not None else "recomputed" if offset < num_recomputed else "computed"
            pieces.append((start + offset, token_ids[offset: offset + count], origin, owner or None, block_tier))
        at += len(token_ids)
    if at != len(reuse.token_ids):
        logger.warning("prompt spans: %d stream tokens expected, %d found; no spans reported", len(reuse.token_ids), at)
        return None
    return _merged(pieces)


def _merged(pieces: list[tuple[int, tuple[int, ...], str, str | None, str | None]]) -> tuple[PromptSpan, ...]:
    """(start, tokens, origin, module, tier) pieces as PromptSpans, merged while they touch and agree."""
    spans: list[tuple[int, list[int], str, str | None, str | None]] = []
    for start, token_ids, origin, module, tier in pieces:
        last = spans[-1] if spans else None
        if last is not None and last[0] + len(last[1]) == start and last[2:] == (origin, module, tier):
            last[1].extend(token_ids)
        else:
            spans.append((start, list(token_ids), origin, module, tier))
    return tuple(PromptSpan(span[0], tuple(span[1]), *span[2:]) for span in spans)


def _tier_runs(links: tuple[Link, ...]) -> list[tuple[int, int, str]]:
    """(first stream index, end, tier) of consecutive prefix links from one tier: one piece each."""
    runs: list[tuple[int, int, str]] = []
    for link in links:
        if runs and runs[-1][1] == link.start and runs[-1][2] == link.tier:
            runs[-1] = (runs[-1][0], link.end, link.tier)
        else:
            runs.append((link.start, link.end, link.tier))
    return runs


def _pieces(at: int, num_tokens: int, num_recomputed: int, reused: list[tuple[int, int, str]], ends: list[int]):
    """(offset, count, prefix blocks' tier or None) pieces of stream tokens [at, at + num_tokens), cut where a
    tier run of `reused` prefix blocks ends (`ends`: their ends) and after the first `num_recomputed`."""
    if num_recomputed == 0 and (not ends or at >= ends[-1]):  # the common case: computed, in one piece
        yield 0, num_tokens, None
        return
    offset = 0
    while offset < num_tokens:
        i = bisect.bisect_right(ends, at + offset)  # the first run ending after this token
        if i < len(reused) and reused[i][0] <= at + offset:
            end, tier = min(num_tokens, reused[i][1] - at), reused[i][2]
        else:
            end, tier = (num_recomputed if offset < num_recomputed else num_tokens), None
        yield offset, end - offset, tier
        offset = end


def _run_module(plan: PromptPlan, run: NewRun) -> str | None:
    """The module a new run belongs to: an uncached module's own tokens, or the module of an argument
    (its source is `<module path>.<param name>`); None for the prompt's text and role markup."""
    if run.kind == "module":
        return run.source or None
    if run.kind == "argument":
        return max((p for p in plan.module_paths if run.source.startswith(p + ".")), key=len, default=None)
    return None


def failure_event(request: Request, exc: BaseException) -> TokenEvent:
    """The event failing a request: bad input says why; anything else is logged under an id the caller gets."""
    if isinstance(exc, InvalidRequestError):
        return rejection_event(request, str(exc))
    error_id = uuid.uuid4().hex[:12]
    logger.error("request %s failed (error id %s)", request.request_id, error_id, exc_info=exc)
    return error_event(request.request_id, f"internal error (id {error_id})", ErrorKind.INTERNAL)


def rejection_event(request: Request, message: str) -> TokenEvent:
    """The event that refuses a request that cannot be served as sent, saying why."""
    return error_event(request.request_id, message, ErrorKind.INVALID_REQUEST)


def error_event(request_id: str, message: str, kind: ErrorKind) -> TokenEvent:
    """The last event of a request that failed: its report carries only the error."""
    return TokenEvent(request_id, 0, None, "", FinishReason.ERROR, report=RequestReport(error=message, error_type=kind))
