"""Assembling a request's KV at admission: the module KV its ReusePlan reuses, the prefix blocks its
stream reuses, and the tokens left to compute."""

from __future__ import annotations

import time
from dataclasses import dataclass

from promptcache.cache_store import KVBlock
from promptcache.model_runtime.engine.prefix import PrefixReuse, Stream, shared_name
from promptcache.model_runtime.engine.request import Request, SharedKV
from promptcache.model_runtime.engine.reuse_plan import CachedUse, ReusePlan
from promptcache.model_runtime.module_encoder import ModuleEncoder, check_positions
from promptcache.model_runtime.results import ModuleUse, slowest_tier


@dataclass(eq=False)
class Assembled:
    """What a request's first sequence starts from."""

    shared: list[SharedKV]       # reused KV (views of stored blocks), with what may see it
    token_ids: list[int]         # stream tokens left to compute
    position_ids: list[int]
    stream: Stream


def store_key(name: str) -> str:
    """The store key of a shared block's name: names of views ("key#first:last", "key#@shift") hold and
    count the stored block they are cut or derived from."""
    return name.partition("#")[0]


def module_key(encoder: ModuleEncoder, request: Request, use: CachedUse) -> str:
    cached = use.cached
    return encoder.key(request.plan.schema, cached.segment.segment_id, cached.context_ids, request.cache_salt)


def assemble(request: Request, reuse: ReusePlan, encoder: ModuleEncoder, prefix: PrefixReuse) -> Assembled:
    """Fetch (encoding on a miss) the module KV of `reuse`, look up the stream's stored prefix, and set
    the request's module report, the tier of each use and timings. Raises PromptTooLongError for
    positions past the model."""
    plan, loaded = request.plan, encoder.loaded
    device = loaded.model.device
    started = time.perf_counter()
    before = encoder.num_encoded_segments
    shared: list[SharedKV] = []
    tiers: dict[str, list[str]] = {}
    use_tiers: list[str] = []
    for use in reuse.uses:
        segment = use.cached.segment
        fetched = encoder.fetch(plan.schema, segment.segment_id, use.cached.context_ids, request.cache_salt)
        block = fetched.block.to(device)
        key = module_key(encoder, request, use)
        if (use.first, use.last) != (0, block.num_tokens):  # a view of the stored block: a distinct tensor
            block = KVBlock(block.keys[:, :, use.first: use.last], block.values[:, :, use.first: use.last],
                            block.position_ids[use.first: use.last])
            key = f"{key}#{use.first}:{use.last}"
        if use.shift:  # keys moved for this request only (rope_shift.py), when the runner attends them
            key = f"{key}{'' if '#' in key else '#'}@{use.shift}"
        shared.append(SharedKV(key, block, use.visible_from, use.shift))
        tiers.setdefault(segment.owner, []).append(fetched.tier)
        use_tiers.append(fetched.tier)
    if encoder.num_encoded_segments != before:
        request.encode_ms = (time.perf_counter() - started) * 1e3

    module_keys = [module_key(encoder, request, use) for use in reuse.uses]
    looked_up = time.perf_counter()
    stream = prefix.open(module_keys, list(reuse.token_ids), list(reuse.position_ids), salt=request.cache_salt,
                         variant=reuse.variant, match=request.params.prompt_logprobs is None)
    reused = stream.num_reused
    request.lookup_ms = (time.perf_counter() - looked_up) * 1e3
    # Reused prefix blocks precede every stream token left to compute; module KV's visibility counts
    # stream tokens, of which the first `reused` are no longer computed.
    shared = [SharedKV(s.key, s.block, max(0, s.visible_from - reused), s.shift) for s in shared]
    shared += [SharedKV(shared_name(link), link.block.to(device)) for link in stream.match.links]
    token_ids, positions = list(reuse.token_ids[reused:]), list(reuse.position_ids[reused:])
    check_positions(positions, loaded.max_positions)

    recomputed = dict(reuse.recomputed_from(reused))  # what this request recomputes itself
    used = {}
    for use in reuse.uses:
        used[use.cached.segment.owner] = used.get(use.cached.segment.owner, 0) + use.last - use.first
    request.use_tiers = tuple(use_tiers)
    after = reuse.encoded_after(plan.schema)
    request.modules = tuple(ModuleUse(path, used.get(path, 0), slowest_tier(tiers.get(path, ["computed"])),
                                      recomputed.get(path, 0), after.get(path)) for path in plan.module_paths)
    request.assembly_ms = (time.perf_counter() - started) * 1e3
    return Assembled(shared, token_ids, positions, stream)
