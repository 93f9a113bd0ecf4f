"""What a request's final event reports: usage, module and prefix reuse, prompt spans, timings."""

from __future__ import annotations

from dataclasses import dataclass

# Slowest last: a module's reported tier is the slowest tier any of its segments came from.
TIER_ORDER = ("device", "host", "redis", "disk", "computed")


@dataclass(frozen=True, slots=True)
class ModuleUse:
    """A module the prompt used: its path, the tokens of its KV reused, where that KV came from, and
    how many of its tokens were recomputed in their actual context (fidelity modes); `encoded_after`
    names the predecessor module whose second encoding was reused (fidelity context "predecessor")."""

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
    """Prompt tokens at consecutive layout positions [start, start + num_tokens) whose KV came from one
    place. `origin`: "module" (a module's cached KV, from `tier`), "prefix" (an automatic prefix block,
    from `tier`), "recomputed" (a module's tokens computed for this request instead of reused: fidelity
    balanced / exact) or "computed" (new text, arguments, uncached modules, computed now). `module` names
    the module the tokens belong to (None: the prompt's own text or the schema's always-included text).
    Positions are the schema layout's (exact fidelity computes the tokens after its reused lead at
    contiguous positions; the layout position is still reported)."""

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
