"""The Python SDK against a real server: sync, async, streaming, errors, builder-made schemas."""

from __future__ import annotations

import pytest

from promptcache.clients import (
    AssistantTurn,
    AsyncClient,
    BadRequestError,
    Client,
    ConflictError,
    Import,
    Module,
    NotFoundError,
    Prompt,
    Schema,
    System,
    User,
)

SCHEMA = Schema("kb", [System("Answer briefly."),
                       User([Module("cats", "Cats sleep a lot."), Module("tea", "Tea is brewed hot.")])])
PROMPT = Prompt("kb", [User([Import("cats"), "Who sleeps?"]), AssistantTurn()]).to_pml()


@pytest.fixture
def server(live_server):
    return live_server()


def test_sync_client_end_to_end(server):
    with Client(server.url, max_retries=0) as client:
        assert client.health()
        info = client.schemas.create(SCHEMA.to_pml())
        assert info.name == "kb" and [m.path for m in info.modules] == ["cats", "tea"]
        # the system turn and the role tags around the modules: before the first and after the last
        assert info.always_included[0][0] == 0 and info.always_included[0][1] == info.modules[0].start
        assert info.always_included[-1] == (info.modules[-1].end, info.num_tokens)
        with pytest.raises(ConflictError):
            client.schemas.create(SCHEMA.to_pml())
        result = client.generate(PROMPT, max_tokens=5, temperature=0)
        assert result.usage.completion_tokens >= 1 and result.cache.modules[0].path == "cats"
        streamed = "".join(c.choices[0].text for c in client.generate(PROMPT, max_tokens=5, temperature=0,
                                                                       stream=True))
        assert streamed == result.text
        explanation = client.explain(PROMPT)
        assert explanation.schema_name == "kb" and explanation.modules[0].tier == "device"
        with pytest.raises(BadRequestError, match="ghost"):
            client.generate(Prompt("kb", [Import("ghost")]).to_pml())
        client.schemas.delete("kb")
        with pytest.raises(NotFoundError):
            client.schemas.get("kb")


async def test_async_client_end_to_end(server):
    async with AsyncClient(server.url, max_retries=0) as client:
        assert await client.health()
        await client.schemas.create(SCHEMA.to_pml())
        assert [s.name for s in await client.schemas.list()] == ["kb"]
        result = await client.generate(PROMPT, max_tokens=4, temperature=0, n=2)
        assert [c.index for c in result.choices] == [0, 1] and result.choices[0].text == result.choices[1].text
        chunks = [c async for c in await client.generate(PROMPT, max_tokens=4, temperature=0, stream=True)]
        assert chunks[-1].usage is not None and "".join(c.choices[0].text for c in chunks) == result.text


def test_fidelity_and_spans_through_the_sdk(server):
    # "tea" after "cats" was not encoded after "cats": out of context, so the modes differ.
    prompt = Prompt("kb", [User([Import("cats"), Import("tea"), "What is hot?"]), AssistantTurn()]).to_pml()
    with Client(server.url, max_retries=0) as client:
        client.schemas.create(SCHEMA.to_pml())
        plain = client.generate(prompt, max_tokens=3, temperature=0, fidelity="fast")
        assert plain.cache.fidelity == "fast" and plain.cache.spans is None  # spans only when asked
        balanced = client.generate(prompt, max_tokens=3, temperature=0, fidelity="balanced",
                                   fidelity_head_tokens=2, return_spans=True)
        assert balanced.cache.fidelity == "balanced" and balanced.cache.recomputed_tokens == 2
        spans = balanced.cache.spans
        assert sum(s.num_tokens for s in spans) == balanced.usage.prompt_tokens
        assert sum(s.num_tokens for s in spans if s.origin == "recomputed") == 2
        assert {s.module for s in spans if s.origin == "recomputed"} == {"tea"}
        chunks = list(client.generate(prompt, max_tokens=3, temperature=0, fidelity="exact", return_spans=True,
                                      stream=True))
        final = chunks[-1].cache
        assert final.fidelity == "exact" and final.exact
        assert [s.start for s in final.spans] == sorted(s.start for s in final.spans)
        # a and c without b between them: c sits after a gap, re-aligned unless the layout is asked for
        gap = Schema("gap", [System("Answer briefly."), User([Module("a", "Cats sleep a lot."),
                                                              Module("b", "Dogs bark."), Module("c", "Tea is hot.")])])
        client.schemas.create(gap.to_pml())
        skip_b = Prompt("gap", [User([Import("a"), Import("c"), "What is hot?"]), AssistantTurn()]).to_pml()
        moved = client.generate(skip_b, max_tokens=3, temperature=0, fidelity="fast")
        kept = client.generate(skip_b, max_tokens=3, temperature=0, fidelity="fast", fidelity_positions="layout")
        assert (moved.cache.positions, kept.cache.positions) == ("contiguous", "layout")

