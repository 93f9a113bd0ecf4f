"""Assembling a request's KV at admission: the module KV its ReusePlan reuses, the prefix blocks its
stream reuses, and the tokens left to compute."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from promptcache.cache_store import KVBlock, LayerReach, window_reach
from promptcache.model_runtime.engine.prefix import KVView, PrefixReuse
from promptcache.model_runtime.engine.request import Request, SharedKV
from promptcache.model_runtime.engine.reuse_plan import CachedUse
from promptcache.model_runtime.errors import InvalidRequestError
from promptcache.model_runtime.module_encoder import ModuleEncoder, check_positions
from promptcache.model_runtime.results import ModuleUse, slowest_tier
from promptcache.model_runtime.sampling import PromptTokens


@dataclass(eq=False)
class Assembled:
    """What a request's first sequence starts from."""

    shared: list[SharedKV]       # reused KV (views of stored blocks), with what may see it
    token_ids: list[int]         # stream tokens left to compute
    position_ids: list[int]
    next_position: int           # of the first generated token


@dataclass(frozen=True, slots=True)
class MissingModules:
    """Module KV no tier gave (evicted, or refused by the fetch policy): the request waits while it is encoded."""

    uses: tuple[CachedUse, ...]


def module_key(encoder: ModuleEncoder, request: Request, use: CachedUse) -> str:
    cached = use.cached
    return encoder.key(request.plan.schema, cached.segment.segment_id, cached.context_ids, request.cache_salt)


def missing_modules(encoder: ModuleEncoder, request: Request) -> list[CachedUse]:
    """The uses of module KV `request` reuses that no tier holds now (and nobody encoded for it)."""
    assert request.reuse is not None
    return [u for u in request.reuse.uses if (key := module_key(encoder, request, u)) not in request.computed_kv
            and encoder.store.tier_of(key) is None]


def assemble(request: Request, encoder: ModuleEncoder, prefix: PrefixReuse) -> Assembled | MissingModules:
    """Fetch the request's module KV (or what was encoded for it; none: MissingModules), open its stream and set its
    report fields. Raises PromptTooLongError, InvalidRequestError."""
    plan, loaded, reuse, params = request.plan, encoder.loaded, request.reuse, request.params
    assert reuse is not None
    if params.prompt_logprobs is not None and reuse.uses:
        raise InvalidRequestError("prompt logprobs need every prompt token computed; this prompt reuses "
                                  "module KV (send it as plain text or token ids)")
    device = loaded.model.device
    started = time.perf_counter()
    shared: list[SharedKV] = []
    tiers: dict[str, list[str]] = {}
    used: dict[str, int] = {}  # tokens of KV reused, by module path
    use_tiers: list[str] = []
    missing: list[CachedUse] = []
    module_keys = [module_key(encoder, request, use) for use in reuse.uses]
    # Sliding-window layers read only what the request's first query (and so any later one) still reaches.
    first_query = min(reuse.position_ids, default=reuse.next_position)
    for use, key in zip(reuse.uses, module_keys):
        segment = use.cached.segment
        if key in request.computed_kv:
            block, tier = request.computed_kv[key], "computed"
        else:
            reach = _reach(loaded.layer_windows, segment.position_ids, use.first, first_query, use.shift)
            fetched = encoder.fetch(plan.schema, segment.segment_id, use.cached.context_ids, request.cache_salt,
                                    reach=reach)
            if fetched is None:
                missing.append(use)
                continue
            block, tier = fetched
        block = block.to(device)
        part = _part(block)
        # A range of the stored block is a distinct tensor; shifted keys move for this request only, when
        # the runner attends them.
        view = KVView(key, shift=use.shift, part=part)
        if (use.first, use.last) != (0, block.num_tokens):
            block = KVBlock(block.keys[:, :, use.first: use.last], block.values[:, :, use.first: use.last],
                            block.position_ids[use.first: use.last])
            view = KVView(key, use.first, use.last, use.shift, part)
        shared.append(SharedKV(view, block, use.visible_from))
        tiers.setdefault(segment.owner, []).append(tier)
        used[segment.owner] = used.get(segment.owner, 0) + use.last - use.first
        use_tiers.append(tier)
    if missing:
        return MissingModules(tuple(missing))
    request.computed_kv = {}  # held by its shared KV from here on
    looked_up = time.perf_counter()
    stream = prefix.open(module_keys, list(reuse.token_ids), list(reuse.position_ids), salt=request.cache_salt,
                         variant=reuse.variant, match=request.params.prompt_logprobs is None)
    reused = stream.num_reused
    request.lookup_ms = (time.perf_counter() - looked_up) * 1e3
    # Reused prefix blocks precede every stream token left to compute; module KV's visibility counts
    # stream tokens, of which the first `reused` are no longer computed.
    shared = [SharedKV(s.view, s.block, max(0, s.visible_from - reused)) for s in shared]
    # A partly used link is a range of its block: a distinct tensor, a view other than the whole block.
    shared += [SharedKV(KVView(link.key, part=_part(link.block)) if link.is_whole else
                        KVView(link.key, 0, link.num_tokens), link.block.to(device)) for link in stream.match.links]
    token_ids, positions = list(reuse.token_ids[reused:]), list(reuse.position_ids[reused:])
    check_positions(positions, loaded.max_positions)
    recomputed = dict(reuse.recomputed_from(reused))  # what this request recomputes itself
    request.use_tiers = tuple(use_tiers)
    after = reuse.encoded_after(plan.schema)
    request.modules = tuple(ModuleUse(path, used.get(path, 0), slowest_tier(tiers.get(path, ["computed"])),
                                      recomputed.get(path, 0), after.get(path)) for path in plan.module_paths)
    request.stream, request.num_computed_tokens = stream, len(token_ids)
    # A view (a range or shifted keys) shares its block's storage: it is held under its store key.
    request.held_keys = tuple(dict.fromkeys(s.view.key for s in shared))
    if params.prompt_logprobs is not None:
        request.prompt_logprobs = []
    if params.uses_prompt_tokens:  # the whole prompt, reused tokens included; shared by the n samples
        request.prompt_tokens = PromptTokens(plan.token_ids())
    request.assembly_ms = (time.perf_counter() - started) * 1e3
    return Assembled(shared, token_ids, positions, reuse.next_position)


def _part(block: KVBlock) -> tuple[int, ...] | None:
    """What of a block a part holds (a view name's `part`); None: all of it."""
    return None if block.present is None else block.present.first_tokens


def _reach(windows: tuple[int | None, ...], position_ids: Sequence[int], first: int, first_query: int,
           shift: int) -> LayerReach | None:
    """What a request whose first query is at `first_query` reads of a module block (of which it uses tokens from
    `first` on, at `position_ids`, moved by `shift`): per sliding-window layer its tail in reach, every token
    elsewhere; None when it reads all of it."""
    reach = window_reach(windows, position_ids, first_query, shift)
    if reach is None or first == 0:
        return reach
    return LayerReach(tuple(max(first, t) for t in reach.first_tokens), reach.num_tokens)  # none before `first`
