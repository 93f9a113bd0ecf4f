"""CacheReport: what a prompt reused, from where, and what it computed — built once, here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from promptcache.model_runtime.engine.reuse_plan import ReusePlan
from promptcache.model_runtime.modes import ContextMode, FidelityMode, PositionMode
from promptcache.model_runtime.results import ModuleUse, PrefixUse, PromptSpan, Usage, slowest_tier
from promptcache.pml import PromptPlan


@dataclass(frozen=True, slots=True)
class CacheReport:
    """The cache side of one prompt: served (a request's final report) or planned (`explain`).

    `modules` follow the plan's module paths; a planned module's `tier` is None when some of its KV is in
    no tier (it would be computed). `approximations` is empty for an exact prompt. `spans` only when the
    request asked for them.
    """

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
                  modules: tuple[ModuleUse, ...], prefix: PrefixUse | None,
                  spans: tuple[PromptSpan, ...] | None) -> CacheReport:
    """The report of a served request (engine/reports.py): `reuse` as resolved at admission (None: the
    request ended before it was admitted), `mode` the fidelity mode it asked for, `usage` its counts."""
    is_exact = reuse.is_exact if reuse is not None else plan.is_exact
    positions = reuse.positions if reuse is not None else PositionMode.LAYOUT
    context = reuse.context if reuse is not None else ContextMode.SCHEMA
    return CacheReport(plan.schema.name, is_exact, plan.generation_prompt_added, mode, positions, context,
                       usage.recomputed_tokens, () if is_exact else plan.approximations, modules, prefix,
                       usage.prompt_tokens, usage.cached_tokens, spans)


def planned_report(plan: PromptPlan, reuse: ReusePlan, use_tiers: Sequence[str | None],
                   blocks: Sequence[tuple[str, int]]) -> CacheReport:
    """The report of serving `plan` now: `use_tiers` is the tier holding each of `reuse.uses` (None: in
    none), `blocks` the (tier, tokens) of each stored prefix block its stream would reuse."""
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
    prefix = None
    if blocks:
        by_tier: dict[str, int] = {}
        for tier_name, count in blocks:
            by_tier[tier_name] = by_tier.get(tier_name, 0) + count
        prefix = PrefixUse(sum(count for _, count in blocks), len(blocks), tuple(sorted(by_tier.items())))
    num_cached = held_tokens + (prefix.num_tokens if prefix is not None else 0)
    return CacheReport(plan.schema.name, reuse.is_exact, plan.generation_prompt_added, reuse.mode, reuse.positions,
                       reuse.context, reuse.num_recomputed, () if reuse.is_exact else plan.approximations,
                       tuple(modules), prefix, plan.num_prompt_tokens, num_cached)
