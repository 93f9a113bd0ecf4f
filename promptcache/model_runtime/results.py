"""What a request's final event reports: usage, module and prefix reuse, prompt spans, timings, and the
CacheReport of what a prompt reused, from where, and what it computed (built once, here)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from promptcache.model_runtime.engine.reuse_plan import ContextMode, FidelityMode, PositionMode, ReusePlan
from promptcache.pml import PromptPlan

# Slowest last: a module's reported tier is the slowest tier any of its segments came from.
TIER_ORDER = ("device", "host", "redis", "disk", "computed")


@dataclass(frozen=True, slots=True)
class ModuleUse:
    """A module the prompt used: its path, tokens of its KV reused and from where, tokens recomputed in context, and
    `encoded_after`: the predecessor whose second encoding was reused."""

    path: str
    num_tokens: int
    tier: str | None  # None: a planned module some of whose KV no tier holds (it would be computed)
    num_recomputed: int = 0
    encoded_after: str | None = None


@dataclass(frozen=True, slots=True)
class PrefixUse:
    """Prompt tokens reused from stored prefix blocks (automatic prefix reuse), by tier."""

    num_tokens: int
    num_blocks: int
    tiers: tuple[tuple[str, int], ...]  # (tier, tokens) pairs, sorted by tier name


@dataclass(frozen=True, slots=True)
class PromptSpan:
    """Prompt tokens at consecutive layout positions [start, end) whose KV came from one place: `origin` "module" or
    "prefix" (from `tier`), "recomputed" or "computed"; `module` None: the prompt's own text."""

    start: int
    token_ids: tuple[int, ...]
    origin: str
    module: str | None = None
    tier: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int    # prompt tokens whose KV was reused: module KV and prefix blocks
    computed_tokens: int  # prompt tokens computed for this request (new text, arguments, recomputed KV)
    completion_tokens: int
    recomputed_tokens: int = 0  # tokens of cached module KV recomputed in their actual context

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Timings:
    encode_ms: float    # modules encoded on demand because no tier had them
    assembly_ms: float  # gathering cached KV into the request buffer (includes encode_ms)
    lookup_ms: float    # looking up stored prefix blocks (part of assembly_ms)
    prefill_ms: float   # computing the new tokens against the cached KV
    ttft_ms: float      # submit -> first token sampled
    total_ms: float


def slowest_tier(tiers: list[str]) -> str:
    rank = {name: i for i, name in enumerate(TIER_ORDER)}
    return max(tiers, key=lambda t: rank.get(t, len(TIER_ORDER)), default="device")


@dataclass(frozen=True, slots=True)
class CacheReport:
    """The cache side of one prompt, served or planned (`explain`); a planned module's `tier` None: not all held."""

    schema_name: str
    is_exact: bool
    generation_prompt_added: bool
    fidelity: FidelityMode
    positions: PositionMode
    context: ContextMode
    num_recomputed: int
    approximations: tuple[str, ...]
    modules: tuple[ModuleUse, ...]
    prefix: PrefixUse | None
    num_prompt_tokens: int
    num_cached: int
    spans: tuple[PromptSpan, ...] | None = None

    @property
    def num_to_compute(self) -> int:
        return self.num_prompt_tokens - self.num_cached


def served_report(plan: PromptPlan, reuse: ReusePlan | None, mode: FidelityMode, usage: Usage,
                  modules: tuple[ModuleUse, ...], blocks: Sequence[tuple[str, int]],
                  spans: tuple[PromptSpan, ...] | None) -> CacheReport:
    """The report of a served request (`reuse` None: never admitted; `blocks`: its prefix blocks' tier, tokens)."""
    is_exact, positions, context = ((plan.is_exact, PositionMode.LAYOUT, ContextMode.SCHEMA) if reuse is None
                                    else (reuse.is_exact, reuse.positions, reuse.context))
    return CacheReport(plan.schema.name, is_exact, plan.generation_prompt_added, mode, positions, context,
                       usage.recomputed_tokens, () if is_exact else plan.approximations, modules, prefix_use(blocks),
                       usage.prompt_tokens, usage.cached_tokens, spans)


def planned_report(plan: PromptPlan, reuse: ReusePlan, use_tiers: Sequence[str | None],
                   blocks: Sequence[tuple[str, int]]) -> CacheReport:
    """The report of serving `plan` now: `use_tiers` holds each of `reuse.uses` (None: none), `blocks` its prefix."""
    used: dict[str, int] = {}
    found: dict[str, list[str | None]] = {}
    for use, tier in zip(reuse.uses, use_tiers):
        owner = use.cached.segment.owner
        used[owner] = used.get(owner, 0) + use.last - use.first
        found.setdefault(owner, []).append(tier)
    recomputed, after = dict(reuse.recomputed), reuse.encoded_after(plan.schema)
    modules = []
    for path in plan.module_paths:
        tiers = found.get(path, [])
        held = [t for t in tiers if t is not None]
        tier = None if not tiers or len(held) < len(tiers) else slowest_tier(held)
        modules.append(ModuleUse(path, used.get(path, 0), tier, recomputed.get(path, 0), after.get(path)))
    held_tokens = sum(u.last - u.first for u, t in zip(reuse.uses, use_tiers) if t is not None)
    prefix = prefix_use(blocks)
    num_cached = held_tokens + (prefix.num_tokens if prefix is not None else 0)
    return CacheReport(plan.schema.name, reuse.is_exact, plan.generation_prompt_added, reuse.mode, reuse.positions,
                       reuse.context, reuse.num_recomputed, () if reuse.is_exact else plan.approximations,
                       tuple(modules), prefix, plan.num_prompt_tokens, num_cached)


def prefix_use(blocks: Sequence[tuple[str, int]]) -> PrefixUse | None:
    """What a stream reuses of the stored prefix blocks `blocks`, each (tier, tokens); None for none."""
    tiers: Counter[str] = Counter()
    for tier, count in blocks:
        tiers[tier] += count
    return PrefixUse(sum(tiers.values()), len(blocks), tuple(sorted(tiers.items()))) if blocks else None
