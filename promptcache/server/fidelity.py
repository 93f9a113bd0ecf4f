"""A schema's fidelity report: sampled prompts served through the engine as the tenant's requests, in each fidelity
mode and as a full prefill (its tokens under a salt of their own: no stored block or logits serve it), compared on their
first token (greedy agreement, a lower bound of the KL); and the report cache."""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal
from xml.sax.saxutils import escape, quoteattr

from promptcache.model_runtime import MAX_LOGPROBS, Fidelity, FidelityMode, SamplingParams, TokenEvent
from promptcache.pml import Module, PromptPlan, RoleSection, Schema, TextEncoder, Union
from promptcache.server import wire
from promptcache.server.errors import UnsupportedParameterError
from promptcache.server.generation import raise_for_error

if TYPE_CHECKING:
    from promptcache.server.service import PromptService

MODES: tuple[Literal["exact", "fast", "balanced"], ...] = ("exact", "fast", "balanced")
MAX_SAMPLES = 64  # each costs a full prefill and one request per mode
DEFAULT_QUESTION = "What is this about? Answer in one sentence."
PROMPTS_IN_FLIGHT = 4  # sampled prompts whose requests are queued at once: the tenant's other requests keep a turn
MAX_CACHED_REPORTS = 64
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0, logprobs=MAX_LOGPROBS)
PLACEHOLDER_ARGUMENT = "example"
DRAWS_PER_SAMPLE = 20  # draws tried per distinct combination wanted: a small schema has few of them


@dataclass(frozen=True, slots=True)
class ReportOptions:
    """A report's sample and modes, defaults resolved (hashable: part of the cache key)."""

    num_samples: int
    seed: int
    question: str
    max_imports: int | None
    fidelity: Fidelity  # head tokens, positions and context; each mode runs with these

    @property
    def num_requests(self) -> int:
        """Requests the report sends at most: a full prefill and one per mode per sample."""
        return self.num_samples * (1 + len(MODES))


@dataclass(frozen=True, slots=True)
class _FirstToken:
    token_id: int
    top: dict[int, float]  # id -> logprob of the MAX_LOGPROBS most likely first tokens


def report_options(query: wire.FidelityReportQuery, service: PromptService) -> ReportOptions:
    """The options of `query` with the server's defaults. Raises UnsupportedParameterError past MAX_SAMPLES."""
    if query.num_samples > MAX_SAMPLES:
        raise UnsupportedParameterError(f"num_samples is {query.num_samples}; this server allows at most "
                                        f"{MAX_SAMPLES} per fidelity report")
    question = DEFAULT_QUESTION if query.question is None else query.question
    return ReportOptions(query.num_samples, query.seed, question, query.max_imports, service.fidelity("fast", query))


async def build_report(service: PromptService, schema: Schema, tenant: str | None,
                       options: ReportOptions) -> wire.FidelityReport:
    """Sample, serve every sample in each mode and as a full prefill, compare first tokens. Raises what
    planning or serving a sample raises (PmlError, QueueFullError, the engine's errors)."""
    started = time.perf_counter()
    samples = await asyncio.to_thread(sample_prompts, schema, service.runtime.text_encoder,
                                      num_samples=options.num_samples, seed=options.seed,
                                      question=options.question, max_imports=options.max_imports)
    plans = await asyncio.to_thread(lambda: [service.plan(prompt, tenant=tenant) for prompt in samples])
    gate = asyncio.Semaphore(PROMPTS_IN_FLIGHT)

    async def serve(plan: PromptPlan) -> tuple[_FirstToken, dict[str, _FirstToken]]:
        async with gate:
            full = service.runtime.plan_tokens(plan.token_ids())
            # Each stream is read from as soon as it is queued: if a later submit fails, those queued
            # still run to their end and free what they hold.
            salt = f"fidelity-report-{uuid.uuid4().hex}"  # no other request's: no block or logits it stored
            calls = [asyncio.ensure_future(_first_token(service.submit(
                full, FIRST_TOKEN, salt, _request_id(), Fidelity(FidelityMode.EXACT), tenant)))]
            calls += [asyncio.ensure_future(_first_token(service.submit(
                plan, FIRST_TOKEN, None, _request_id(), replace(options.fidelity, mode=FidelityMode(mode)), tenant)))
                for mode in MODES]
            reference, *answers = await asyncio.gather(*calls)
            return reference, dict(zip(MODES, answers))

    served = await asyncio.gather(*(serve(plan) for plan in plans))
    rows = [wire.FidelitySample(
        module_paths=list(plan.module_paths), prompt=sample, prompt_tokens=plan.num_prompt_tokens, exact=plan.is_exact,
        modes={mode: wire.FidelitySampleResult(top1_agrees=answer.token_id == reference.token_id,
                                               kl=first_token_kl(reference.top, answer.top))
               for mode, answer in answers.items()})
        for sample, plan, (reference, answers) in zip(samples, plans, served)]
    return wire.FidelityReport(  # type: ignore[call-arg]  # the wire name is the alias (pydantic's mypy plugin)
        schema=schema.name, model=service.model_name, num_samples=len(rows), seed=options.seed,
        question=options.question, max_imports=options.max_imports,
        fidelity_head_tokens=options.fidelity.head_tokens, fidelity_positions=options.fidelity.positions,
        fidelity_context=options.fidelity.context,
        modes={mode: _stats([r.modes[mode] for r in rows]) for mode in MODES}, samples=rows,
        elapsed_ms=round((time.perf_counter() - started) * 1e3, 1))


def first_token_kl(reference: dict[int, float], answer: dict[int, float]) -> float:
    """KL(reference || answer) in nats over the tokens both top lists hold (id -> logprob) plus one
    bucket for the rest of the vocabulary: a lower bound of the KL of the full distributions."""
    common = reference.keys() & answer.keys()
    kl = sum(math.exp(reference[t]) * (reference[t] - answer[t]) for t in common)
    p_rest = max(0.0, 1.0 - sum(math.exp(reference[t]) for t in common))
    q_rest = max(1e-12, 1.0 - sum(math.exp(answer[t]) for t in common))
    if p_rest > 0:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(0.0, kl)


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95 % at z = 1.96)."""
    if n == 0:
        return 0.0, 1.0
    phat = successes / n
    centre = (phat + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # at 0 or n successes the bound on that side is exactly 0 or 1 (the formula's rounding can miss it)
    return 0.0 if successes == 0 else centre - half, 1.0 if successes == n else centre + half


def _stats(results: list[wire.FidelitySampleResult]) -> wire.FidelityModeStats:
    agree = sum(r.top1_agrees for r in results)
    kls = [r.kl for r in results]
    return wire.FidelityModeStats(num_samples=len(results), top1_agreement=agree / max(1, len(results)),
                                  agreement_ci95=wilson(agree, len(results)), mean_kl=sum(kls) / max(1, len(kls)),
                                  max_kl=max(kls, default=0.0))


async def _first_token(events: AsyncIterator[TokenEvent]) -> _FirstToken:
    first = None
    async for event in events:  # to the final event: the request finishes and frees its KV
        raise_for_error(event)
        if first is None and event.token_id is not None and event.logprobs is not None:
            first = _FirstToken(event.token_id, dict(event.logprobs.top))
    assert first is not None, "a finished request has sampled its first token"
    return first


def _request_id() -> str:
    return f"fid-{uuid.uuid4().hex[:24]}"


class ReportCache:
    """Reports by (schema, version, options), least recently used dropped past MAX_CACHED_REPORTS. A report being
    computed is shared by every caller meanwhile; a caller that goes away does not cancel it."""

    def __init__(self) -> None:
        self._done: OrderedDict[Hashable, wire.FidelityReport] = OrderedDict()
        self._running: dict[Hashable, asyncio.Future[wire.FidelityReport]] = {}

    async def get(self, key: Hashable, compute: Callable[[], Awaitable[wire.FidelityReport]],
                  before_compute: Callable[[], None] = lambda: None) -> wire.FidelityReport:
        """The cached report (cached: true), the one in progress, or a new one (`before_compute()` first; may raise)."""
        if key in self._done:
            self._done.move_to_end(key)
            return self._done[key].model_copy(update={"cached": True})
        if (future := self._running.get(key)) is None:
            before_compute()
            future = asyncio.ensure_future(compute())
            self._running[key] = future
            future.add_done_callback(lambda done: self._settle(key, done))
        return await asyncio.shield(future)

    def _settle(self, key: Hashable, future: asyncio.Future[wire.FidelityReport]) -> None:
        self._running.pop(key, None)
        if not future.cancelled() and future.exception() is None:
            self._done[key] = future.result()
            while len(self._done) > MAX_CACHED_REPORTS:
                self._done.popitem(last=False)


# -- the sample: seeded module combinations of a schema, written as PML prompts --------------------------
@dataclass(frozen=True, slots=True)
class _Choice:
    """Import one of `members` (a module alone, or a union's members) or nothing."""

    members: tuple[Module, ...]
    section: RoleSection | None  # the top-level role section that holds it


def sample_prompts(schema: Schema, encoder: TextEncoder, *, num_samples: int, seed: int, question: str,
                   max_imports: int | None = None) -> list[str]:
    """Up to `num_samples` distinct, seeded combinations of `schema`'s modules as `<prompt>` documents (fewer when none
    new turns up in DRAWS_PER_SAMPLE draws each): 1 up to `max_imports` top-level choices (a module, or one member of a
    union), each picked module's nested choices made with probability 1/2, imports nested as in the schema inside their
    section's role, the question in the user turn, then `<assistant/>` (the turn the playground composes)."""
    rng = random.Random(f"fidelity-report-{seed}")
    choices = _choices(schema.root.children, None, is_top=True)
    found: dict[str, None] = {}  # in the order drawn
    for _ in range(num_samples * DRAWS_PER_SAMPLE):
        if len(found) == num_samples:
            break
        found.setdefault(_draw(rng, schema, choices, encoder, question, max_imports))
    return list(found)


def _choices(children, section: RoleSection | None, *, is_top: bool) -> list[_Choice]:
    choices: list[_Choice] = []
    for node in children:
        if isinstance(node, Module):
            choices.append(_Choice((node,), section))
        elif isinstance(node, Union):
            choices.append(_Choice(node.members, section))
        elif isinstance(node, RoleSection):  # transparent for imports; at the top it is the turn they go in
            choices += _choices(node.children, node if is_top else section, is_top=is_top)
    return choices


def _draw(rng: random.Random, schema: Schema, choices: list[_Choice], encoder: TextEncoder, question: str,
          max_imports: int | None) -> str:
    groups: list[tuple[RoleSection | None, list[str]]] = []  # consecutive imports of one section
    if choices:
        count = rng.randint(1, min(len(choices), max_imports or len(choices)))
        for index in sorted(rng.sample(range(len(choices)), count)):  # schema order
            choice = choices[index]
            xml = _import(rng, rng.choice(choice.members), encoder)
            if groups and groups[-1][0] is choice.section:
                groups[-1][1].append(xml)
            else:
                groups.append((choice.section, [xml]))
    body = [f"<{s.role}>{''.join(xs)}</{s.role}>" if s is not None else "".join(xs) for s, xs in groups]
    text = escape(question)
    if groups and groups[-1][0] is not None and groups[-1][0].role == "user":
        body[-1] = body[-1][: -len("</user>")] + text + "</user>"
    elif question.strip():
        body.append(f"<user>{text}</user>")
    return f'<prompt schema="{schema.name}">{"".join(body)}<assistant/></prompt>'


def _import(rng: random.Random, module: Module, encoder: TextEncoder) -> str:
    fits = len(encoder.encode(PLACEHOLDER_ARGUMENT))
    arguments = "".join(f" {name}={quoteattr(PLACEHOLDER_ARGUMENT)}" for name, param in module.params.items()
                        if fits <= param.length)
    inner = "".join(_import(rng, rng.choice(choice.members), encoder)
                    for choice in _choices(module.children, None, is_top=False) if rng.random() < 0.5)
    return f"<{module.name}{arguments}>{inner}</{module.name}>" if inner else f"<{module.name}{arguments}/>"
