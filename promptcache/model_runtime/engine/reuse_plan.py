"""ReusePlan: which cached module KV a request reuses and which tokens it computes, per fidelity mode
(docs/fidelity.md). fast: every cached segment reused as encoded (the paper). balanced: out-of-context segments' first k
tokens recomputed in their actual context (attention sinks, as in EPIC/LegoLink), for this request only. exact: only a
leading run a full prefill computes identically is reused; the rest is computed contiguously. Positions: "layout" keeps
the schema's (gaps for modules not imported); "contiguous" ranks them, rotating reused keys by `shift` (retrieval 32.5 %
-> 54.5 %, full prefill 61.0 %, SmolLM2-135M). Context: "schema" reuses the KV encoded after what the schema guarantees
precedes a module; "predecessor" the second encoding after that and the module before it."""

from __future__ import annotations

import bisect
import enum
import itertools
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

from promptcache.pml import CachedSegment, PromptPlan, Schema


class WireEnum(str, enum.Enum):
    """A str-valued enum that is its value wherever a str is expected (`enum.StrEnum` on Python 3.10 too), hashed as its
    value, so a member and its value are one dict key."""

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return str(self.value)


class FidelityMode(WireEnum):
    """How much approximation a prompt reusing module KV out of its encoding context accepts."""

    FAST = "fast"          # every cached segment reused as encoded
    BALANCED = "balanced"  # out-of-context segments' first k tokens recomputed in their actual context
    EXACT = "exact"        # only KV a full prefill would compute identically is reused


class PositionMode(WireEnum):
    """Where an approximate prompt's tokens sit."""

    CONTIGUOUS = "contiguous"  # each token at its rank among the prompt's positions (reused keys rotated)
    LAYOUT = "layout"          # the schema layout's positions, with gaps for modules not imported


class ContextMode(WireEnum):
    """Which encoding of an out-of-context module is reused."""

    SCHEMA = "schema"            # encoded after what the schema guarantees precedes it
    PREDECESSOR = "predecessor"  # encoded after that and the module just before it in the schema


_Mode = TypeVar("_Mode", bound=WireEnum)


@dataclass(frozen=True, slots=True)
class Fidelity:
    """A request's fidelity mode, `head_tokens` (k), `positions` and `context` (module docstring)."""

    mode: FidelityMode = FidelityMode.FAST
    head_tokens: int = 16
    positions: PositionMode = PositionMode.LAYOUT
    context: ContextMode = ContextMode.SCHEMA

    def __post_init__(self) -> None:
        # A mode given by its value ("fast") is stored as its member.
        object.__setattr__(self, "mode", _member(FidelityMode, self.mode, "fidelity mode"))
        if not 0 <= self.head_tokens <= 4096:
            raise ValueError(f"head_tokens must be in [0, 4096], got {self.head_tokens}")
        object.__setattr__(self, "positions", _member(PositionMode, self.positions, "positions"))
        object.__setattr__(self, "context", _member(ContextMode, self.context, "context"))


def _member(kind: type[_Mode], value: object, name: str) -> _Mode:
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name} must be one of {', '.join(m.value for m in kind)}, got {value!r}") from None


@dataclass(frozen=True, slots=True)
class CachedUse:
    """Tokens [first, last) of a cached segment's stored KV, attended by the stream tokens from index `visible_from` on
    (those before it are positioned before these), keys moved by `shift` for this request."""

    cached: CachedSegment
    first: int
    last: int
    visible_from: int = 0
    shift: int = 0


@dataclass(frozen=True, slots=True)
class ReusePlan:
    """What the engine does for one prompt: reuse `uses`, compute the stream (position order)."""

    mode: FidelityMode
    uses: tuple[CachedUse, ...]
    token_ids: tuple[int, ...]
    position_ids: tuple[int, ...]
    next_position: int                          # position of the first generated token
    recomputes: tuple[str | None, ...]          # per stream token: the module whose cached KV it recomputes
    variant: str                                # names what the stream attends to beyond the module keys
    is_exact: bool
    positions: PositionMode = PositionMode.LAYOUT  # CONTIGUOUS: re-aligned (module docstring)
    context: ContextMode = ContextMode.SCHEMA      # PREDECESSOR: out-of-context modules' second encoding

    def __post_init__(self) -> None:
        assert len(self.recomputes) == len(self.token_ids), "one entry per stream token"

    @property
    def recomputed(self) -> tuple[tuple[str, int], ...]:
        """(module path, tokens of its cached KV the stream recomputes), in stream order."""
        return self.recomputed_from(0)

    @property
    def num_recomputed(self) -> int:
        return sum(count for _, count in self.recomputed)

    def recomputed_from(self, index: int) -> tuple[tuple[str, int], ...]:
        """Per module, what stream tokens from `index` on recompute (the earlier ones came from prefix blocks)."""
        return tuple(Counter(owner for owner in self.recomputes[index:] if owner is not None).items())

    def encoded_after(self, schema: Schema) -> dict[str, str]:
        """Module path -> the module after which its reused "predecessor" encoding was encoded."""
        after = {}
        for use in self.uses:
            extra = [i for i in use.cached.context_ids if i not in use.cached.segment.context_ids]
            if extra and use.cached.variant == "default":
                after[use.cached.segment.owner] = schema.segments[extra[-1]].owner
        return after


def resolve(plan: PromptPlan, fidelity: Fidelity, *, can_shift: bool = True) -> ReusePlan:
    """The ReusePlan of `plan` under `fidelity` (pure). The stream is never empty: an all-cached prompt recomputes its
    last token for its logits. `can_shift=False` (no RoPE) keeps the layout's positions."""
    preceded = fidelity.mode != FidelityMode.EXACT and fidelity.context == ContextMode.PREDECESSOR and not plan.is_exact
    if preceded:
        plan = with_predecessors(plan)
    if fidelity.mode == FidelityMode.EXACT:
        reuse = _exact(plan)
    elif fidelity.mode == FidelityMode.BALANCED and not plan.is_exact:
        k = fidelity.head_tokens
        heads = {i: range(min(k, len(c.segment.token_ids))) for i, c in enumerate(plan.cached)
                 if not in_context(plan, c)}
        reuse = recompute_selected(plan, heads, f"balanced:{k}")
    else:
        token_ids = tuple(plan.new_token_ids())
        reuse = ReusePlan(fidelity.mode, tuple(CachedUse(c, 0, len(c.segment.token_ids)) for c in plan.cached),
                          token_ids, tuple(plan.new_position_ids()), _after(plan), (None,) * len(token_ids), "",
                          plan.is_exact)
    reuse = reuse if reuse.token_ids else _recompute_last(reuse)
    reuse = replace(reuse, context=ContextMode.PREDECESSOR) if preceded else reuse
    realign = can_shift and fidelity.positions == PositionMode.CONTIGUOUS and not reuse.is_exact
    return realigned(reuse) if realign else reuse


def realigned(reuse: ReusePlan) -> ReusePlan:
    """`reuse` with every token at its rank among the prompt's positions (order kept); unchanged if none moves."""
    starts = [u.cached.segment.start + u.first for u in reuse.uses]
    layout = sorted([p for u, start in zip(reuse.uses, starts) for p in range(start, start + u.last - u.first)]
                    + list(reuse.position_ids))
    if layout[-1] == len(layout) - 1:  # already contiguous from 0
        return reuse
    rank = {p: i for i, p in enumerate(layout)}
    uses = tuple(replace(u, shift=rank[start] - start) for u, start in zip(reuse.uses, starts))
    return replace(reuse, uses=uses, position_ids=tuple(rank[p] for p in reuse.position_ids),
                   next_position=len(layout), variant=f"{reuse.variant}@contiguous",
                   positions=PositionMode.CONTIGUOUS)


def _recompute_last(reuse: ReusePlan) -> ReusePlan:
    last = max(reuse.uses, key=lambda u: u.cached.segment.start + u.last)
    segment = last.cached.segment
    shrunk = CachedUse(last.cached, last.first, last.last - 1, last.visible_from)
    uses = tuple(shrunk if u is last else u for u in reuse.uses if u is not last or shrunk.last > shrunk.first)
    # Recomputed for its logits only: the same KV as stored (the stream attends nothing the segment did not).
    return ReusePlan(reuse.mode, uses, (segment.token_ids[last.last - 1],), (segment.start + last.last - 1,),
                     reuse.next_position, (None,), reuse.variant, reuse.is_exact)


def in_context(plan: PromptPlan, cached: CachedSegment) -> bool:
    """True when the segment was encoded after exactly the cached segments before it in this plan
    and no new token precedes it (its stored KV is what a full prefill at these positions computes)."""
    start = cached.segment.start
    before = {c.segment.segment_id for c in plan.cached if c.segment.end <= start}
    return set(cached.context_ids) == before and not any(run.start < start for run in plan.new_runs)


def with_predecessors(plan: PromptPlan) -> PromptPlan:
    """`plan` reusing each out-of-context module segment's encoding after its predecessor."""
    cached = []
    for c in plan.cached:
        if c.variant == "default" and not in_context(plan, c):
            context = plan.schema.predecessor_context(c.segment.segment_id, c.context_ids)
            c = c if context is None else replace(c, context_ids=context)
        cached.append(c)
    return replace(plan, cached=tuple(cached))


def recompute_selected(plan: PromptPlan, chosen: Mapping[int, Iterable[int]], variant: str) -> ReusePlan:
    """A balanced ReusePlan recomputing tokens `chosen[i]` of each cached segment `plan.cached[i]` at their positions,
    reusing the runs between them as stored (balanced: the first k; CacheBlend's or a query-aware choice alike)."""
    # (position, token, the module whose KV it recomputes or None: new text)
    pieces: list[tuple[int, int, str | None]] = [
        (p, t, None) for run in plan.new_runs for p, t in zip(range(run.start, run.end), run.token_ids)]
    picked: list[tuple[CachedSegment, list[int]]] = []
    for index, cached in enumerate(plan.cached):
        segment = cached.segment
        tokens = sorted(set(chosen.get(index, ())))
        assert all(0 <= j < len(segment.token_ids) for j in tokens), "a chosen token outside its segment"
        picked.append((cached, tokens))
        pieces += [(segment.position_ids[j], segment.token_ids[j], segment.owner) for j in tokens]
    pieces.sort(key=lambda piece: piece[0])
    positions = [p for p, _, _ in pieces]
    uses: list[CachedUse] = []
    for cached, tokens in picked:
        bounds = [-1, *tokens, len(cached.segment.token_ids)]
        for before, after in itertools.pairwise(bounds):
            if after > before + 1:  # a run [before + 1, after); a segment's positions are start + index
                visible_from = bisect.bisect_left(positions, cached.segment.start + after)
                uses.append(CachedUse(cached, before + 1, after, visible_from))
    recomputes = tuple(owner for _, _, owner in pieces)
    return ReusePlan(FidelityMode.BALANCED, tuple(uses), tuple(t for _, t, _ in pieces), tuple(positions), _after(plan),
                     recomputes, variant, all(o is None for o in recomputes) and plan.is_exact)


def _exact(plan: PromptPlan) -> ReusePlan:
    """Reuse the leading segments a full prefill computes identically; compute the rest contiguously after them."""
    leading: list[CachedSegment] = []
    for cached in plan.cached:
        reused = sum(len(c.segment.token_ids) for c in leading)
        if cached.segment.start != reused or not in_context(plan, cached):
            break
        leading.append(cached)
    reused = sum(len(c.segment.token_ids) for c in leading)
    rest: list[tuple[int, int, str | None]] = [
        (p, t, c.segment.owner) for c in plan.cached[len(leading):]
        for p, t in zip(c.segment.position_ids, c.segment.token_ids)]
    rest += [(p, t, None) for run in plan.new_runs for p, t in zip(range(run.start, run.end), run.token_ids)]
    rest.sort(key=lambda piece: piece[0])
    token_ids = tuple(t for _, t, _ in rest)
    uses = tuple(CachedUse(c, 0, len(c.segment.token_ids)) for c in leading)
    return ReusePlan(FidelityMode.EXACT, uses, token_ids, tuple(range(reused, reused + len(token_ids))),
                     reused + len(token_ids), tuple(owner for _, _, owner in rest), "", True)


def _after(plan: PromptPlan) -> int:
    return max(plan.position_ids()) + 1
