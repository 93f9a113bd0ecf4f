"""PromptRuntime: the owner a call names is the owner of every KV entry the engine stores for it (module
encodings at upload and on first use, prefix blocks), whatever salt the client sends."""

from __future__ import annotations

import asyncio

import pytest

from promptcache.cache_store import BlockIndexConfig, StoreConfig, build_store
from promptcache.model_runtime import Fidelity, PromptRuntime, SamplingParams
from promptcache.model_runtime.engine import EngineConfig
from tests.conftest import make_tiny_runtime
from tests.model_runtime.test_engine import SCHEMA

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _owners(store) -> dict[str, str | None]:
    """Owner of every stored entry, by key, over every tier."""
    owners: dict[str, str | None] = {}
    for tier in store.tiers:
        stored = tier.keys()
        for key in stored:
            hit = tier.lookup(key)
            if hit is not None:
                owners[key] = hit.owner
    return owners


def _serve(runtime: PromptRuntime, plan, owner: str | None, salt: str | None) -> None:
    async def go() -> None:
        [events] = runtime.submit([plan], GREEDY, owner=owner, salt=salt, request_ids=[f"r-{owner}-{salt}"],
                                  fidelity=Fidelity())
        async for event in events:
            assert event.report is None or event.report.error is None, event.report

    asyncio.run(go())


@pytest.mark.parametrize(("owner", "upload"), [("alpha", True), ("beta", False), (None, False)])
def test_kv_stored_for_an_owner_is_that_owners_whatever_the_client_salt(owner, upload):
    """Uploaded module KV, module KV encoded on a prompt's first use of it, and the prompt's prefix
    blocks all count against the owner named (None: nobody's share), under a client salt of its own."""
    store = build_store(StoreConfig())
    runtime = PromptRuntime(make_tiny_runtime("llama").loaded, store,
                            EngineConfig(prefix=BlockIndexConfig(block_size=4)))
    schema = runtime.parse_schema(SCHEMA)
    prompt = '<prompt schema="lib"><user><d1/><d3/>Which drink is brewed in a pot?</user><assistant/></prompt>'
    try:
        runtime.add_schema(schema, owner)
        if upload:
            runtime.encode_schema(schema, owner).result(timeout=120)
        uploaded = _owners(store)
        assert bool(uploaded) == upload
        _serve(runtime, runtime.plan(prompt, owner), owner, "client-salt")
    finally:
        runtime.stop()  # the engine thread runs a step's prefix writes before it stops
    served = {k: o for k, o in _owners(store).items() if k not in uploaded}
    # Prefix blocks, and the two modules' KV unless the upload stored it: more than two entries either way.
    assert len(served) > 2 and set(uploaded.values()) | set(served.values()) == {owner}
