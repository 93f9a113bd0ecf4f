"""PromptPlan: what the runtime must do for one prompt (cached segments + new token runs)."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

from promptcache.pml.errors import EmptyPromptError
from promptcache.pml.schema import Schema, Segment


@dataclass(frozen=True, slots=True)
class CachedSegment:
    """A schema segment whose KV comes from the cache, encoded after `context_ids`."""

    segment: Segment
    context_ids: tuple[int, ...]
    variant: str  # "default" | "scaffold:<name>" | "isolated"


@dataclass(frozen=True, slots=True)
class NewRun:
    """Tokens computed for this request at positions [start, start + len(token_ids)). `kind`: "text", "argument"
    (a param's value), "role" (role markup the prompt adds) or "module" (a cache="false" module's tokens);
    `source`: the param or module path, else "text" ("generation_prompt" for the turn the parser opened)."""

    token_ids: tuple[int, ...]
    start: int
    kind: str
    source: str
    line: int

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True, slots=True, eq=False)
class PromptPlan:
    """A prompt resolved against its schema; cached segments and new runs in position order. `is_exact`:
    serving it from cache equals a full prefill of `token_ids()` at `position_ids()`; else `approximations`
    says why. `generation_prompt_added`: the last new run opens the assistant turn (`parse_prompt`)."""

    schema: Schema
    cached: tuple[CachedSegment, ...]
    new_runs: tuple[NewRun, ...]
    module_paths: tuple[str, ...]
    approximations: tuple[str, ...]
    generation_prompt_added: bool = False

    @property
    def is_exact(self) -> bool:
        return not self.approximations

    @property
    def num_cached_tokens(self) -> int:
        return sum(len(c.segment.token_ids) for c in self.cached)

    @property
    def num_new_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.new_runs)

    @property
    def num_prompt_tokens(self) -> int:
        return self.num_cached_tokens + self.num_new_tokens

    def new_token_ids(self) -> list[int]:
        return [t for run in self.new_runs for t in run.token_ids]

    def new_position_ids(self) -> list[int]:
        return [p for run in self.new_runs for p in range(run.start, run.end)]

    def token_ids(self) -> list[int]:
        """Every prompt token (cached and new) in position order: the full-prefill input."""
        return [t for _, t in self._by_position()]

    def position_ids(self) -> list[int]:
        return [p for p, _ in self._by_position()]

    def _by_position(self) -> list[tuple[int, int]]:
        pairs = [(p, t) for c in self.cached for p, t in zip(c.segment.position_ids, c.segment.token_ids)]
        pairs += [(p, t) for run in self.new_runs for p, t in zip(range(run.start, run.end), run.token_ids)]
        return sorted(pairs)


def find_approximations(cached: tuple[CachedSegment, ...], new_runs: tuple[NewRun, ...],
                        absent_owner: Callable[[int], str | None] | None = None) -> tuple[str, ...]:
    """Why serving this plan from cache differs from a full prefill (empty: it does not). A cached segment is
    exact when it was encoded after exactly the cached segments before it and no new token precedes it; new
    tokens when none is before a cached token. `absent_owner(segment_id)` names the module of a context
    segment this plan leaves out (a union scaffold member's content), else None."""
    reasons: list[str] = []
    # The first run (in `new_runs` order) starting below p is the first whose running minimum start is.
    lowest = list(accumulate((run.start for run in new_runs), min))
    before: set[int] = set()  # cached segments never share a position: those before one in start order
    for item in sorted(cached, key=lambda c: c.segment.start):
        segment = item.segment
        if len(item.context_ids) != len(before) or not before.issuperset(item.context_ids):
            owner = segment.owner or "the schema's always-included text"
            absent = sorted({o for o in map(absent_owner, item.context_ids) if o}) if absent_owner else []
            if absent:
                reasons.append(f"{owner} at [{segment.start}, {segment.end}) was encoded after the union "
                               f"scaffold member(s) {', '.join(map(repr, absent))} (<union scaffold=...>), "
                               "which this prompt does not import")
            else:
                reasons.append(f"{owner} at [{segment.start}, {segment.end}) was encoded without attending "
                               "to every module before it in this prompt, or with one this prompt leaves out")
        before.add(segment.segment_id)
        first = bisect.bisect_left(lowest, True, key=lambda start: start < segment.start)
        if first < len(new_runs):
            early = new_runs[first]
            reasons.append(f"new {early.kind} at position {early.start} precedes cached tokens at "
                           f"[{segment.start}, {segment.end}), which were encoded without it")
    last_cached = max((c.segment.end for c in cached), default=0)
    late = [run for run in new_runs if run.start < last_cached]
    if late and not any("precedes" in r for r in reasons):
        reasons.append(f"new {late[0].kind} at position {late[0].start} attends to cached tokens after it")
    return tuple(dict.fromkeys(reasons))


def token_plan(schema: Schema, token_ids: tuple[int, ...]) -> PromptPlan:
    """A plan that computes `token_ids` at positions 0..n-1 with nothing cached: plain completions and chats
    (never PML; reuse comes from prefix blocks). `schema` only names where it belongs (the empty plain one)."""
    if not token_ids:
        raise EmptyPromptError("the prompt has no tokens; send at least one")
    return PromptPlan(schema=schema, cached=(), new_runs=(NewRun(tuple(token_ids), 0, "text", "", 1),),
                      module_paths=(), approximations=())
