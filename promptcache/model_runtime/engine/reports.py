"""The events that end a request: its final report, or its failure."""

from __future__ import annotations

import logging
import time
import uuid

from promptcache.model_runtime.engine.prefix import prefix_use
from promptcache.model_runtime.engine.request import Request, TokenEvent
from promptcache.model_runtime.errors import InvalidRequestError
from promptcache.model_runtime.results import Timings, Usage
from promptcache.model_runtime.sampling import TokenLogprobs

logger = logging.getLogger(__name__)


def final_event(request: Request, index: int, token: int | None, text: str, finish: str,
                logprobs: TokenLogprobs | None = None) -> TokenEvent:
    """The request's last event: usage, module and prefix reuse, timings, exactness, fidelity mode."""
    plan, reuse, stream = request.plan, request.reuse, request.stream
    now = time.perf_counter()
    reused = sum(u.last - u.first for u in reuse.uses) if reuse is not None else 0
    reused += stream.num_reused if stream is not None else 0
    usage = Usage(prompt_tokens=plan.num_prompt_tokens, cached_tokens=reused,
                  computed_tokens=request.num_computed_tokens,
                  completion_tokens=sum(len(s.output_ids) for s in request.sequences),
                  recomputed_tokens=reuse.num_recomputed if reuse is not None else 0)
    first = request.first_token_at or now
    timings = Timings(encode_ms=request.encode_ms, assembly_ms=request.assembly_ms, lookup_ms=request.lookup_ms,
                      prefill_ms=request.prefill_ms, ttft_ms=(first - request.submitted_at) * 1e3,
                      total_ms=(now - request.submitted_at) * 1e3)
    prompt_logprobs = tuple(request.prompt_logprobs) if request.prompt_logprobs is not None else None
    return TokenEvent(request.request_id, index, token, text, finish, logprobs, prompt_logprobs, usage=usage,
                      modules=request.modules, prefix=prefix_use(stream.match) if stream is not None else None,
                      timings=timings, is_exact=reuse.is_exact if reuse is not None else plan.is_exact,
                      fidelity=request.fidelity.mode)


def failure_event(request: Request, exc: BaseException) -> TokenEvent:
    """The event that fails one request: bad input says what is wrong; anything else is logged with an
    id that the caller also gets (a 500 that names it), never with internals in the message."""
    if isinstance(exc, InvalidRequestError):
        return TokenEvent(request.request_id, 0, None, "", "error", error=str(exc), error_type="invalid_request")
    error_id = uuid.uuid4().hex[:12]
    logger.error("request %s failed (error id %s)", request.request_id, error_id, exc_info=exc)
    return TokenEvent(request.request_id, 0, None, "", "error", error=f"internal error (id {error_id})",
                      error_type="internal")


def rejection_event(request: Request, message: str) -> TokenEvent:
    return TokenEvent(request.request_id, 0, None, "", "error", error=message, error_type="invalid_request")
