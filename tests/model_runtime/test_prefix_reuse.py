"""Automatic prefix reuse in the engine, against the no-reuse oracle (the HF reference, fp32).

Every test compares greedy tokens of requests that reuse prefix blocks with the same requests computed
from scratch, and checks the reported reuse against what was stored before.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from promptcache.cache_store import BlockIndexConfig, StoreConfig, build_store
from promptcache.model_runtime import SamplingParams
from promptcache.model_runtime.engine import Engine, EngineConfig
from promptcache.model_runtime.engine.outputs import OutputProcessor
from promptcache.model_runtime.engine.prefix import PrefixReuse
from promptcache.model_runtime.engine.request import Request
from promptcache.model_runtime.engine.runner import ModelRunner
from promptcache.model_runtime.engine.scheduler import Scheduler
from promptcache.pml import token_plan
from tests.conftest import make_tiny_runtime
from tests.model_runtime.oracles import reference_tokens
from tests.model_runtime.test_engine import SCHEMA

TEXT = ("The quick brown fox jumps over the lazy dog. Cats sleep most of the day, and tea is brewed with hot "
        "water. Rome was not built in a day. The river flows north through the valley. ") * 3


def _greedy(max_tokens: int = 8, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, n=n)


class Harness:
    """A tiny-llama runtime, its plain schema and an engine with a given prefix block size."""

    def __init__(self, *, block_size: int = 8, store=None, arch: str = "llama", **engine) -> None:
        self.runtime = make_tiny_runtime(arch, store=store)
        self.runtime.add_schema(self.runtime.parse_schema('<schema name="plain"/>'), encode=False)
        self.runtime.add_schema(self.runtime.parse_schema(SCHEMA))
        self.plain = self.runtime.get_schema("plain")
        prefix = BlockIndexConfig(block_size=block_size) if block_size else None
        self.engine = Engine(self.runtime.module_encoder, EngineConfig(prefix=prefix, **engine))
        self.tokenizer = self.runtime.loaded.tokenizer

    def ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def oracle(self, plan, params: SamplingParams) -> list[int]:
        return reference_tokens(self.runtime.loaded, plan, params)

    async def run(self, plan, params: SamplingParams, salt: str | None = None):
        tokens: dict[int, list[int]] = {}
        final = None
        async for event in self.engine.submit(plan, params, cache_salt=salt):
            assert event.report is None or event.report.error is None, event.report
            if event.token_id is not None:
                tokens.setdefault(event.index, []).append(event.token_id)
            if event.report is not None:
                final = event
        return tokens, final

    def run_sync(self, plan, params: SamplingParams, salt: str | None = None):
        return asyncio.run(self.run(plan, params, salt))


@pytest.fixture
def harness(engines):
    return lambda **kwargs: engines(Harness, **kwargs)


@pytest.mark.parametrize("logits_cache", [True, False])
@pytest.mark.parametrize("length", [7, 8, 9, 16, 17, 61])
def test_exact_repeat_reuses_every_token(harness, length, logits_cache):
    """With the last token's logits cached, an exact repeat computes nothing before its first token;
    without, it reuses all but the last token (computed for its logits). Same tokens as the oracle."""
    h = harness(block_size=8, logits_cache_bytes=(1 << 20) if logits_cache else 0)
    ids = h.ids(TEXT)[:length]
    plan = token_plan(h.plain, ids)
    want = h.oracle(plan, _greedy())
    first, first_final = h.run_sync(plan, _greedy())
    steps = h.engine.num_steps
    again, final = h.run_sync(plan, _greedy())
    assert first[0] == want and again[0] == want
    assert first_final.report.usage.cached_tokens == 0 and first_final.report.cache.prefix is None
    reused = length if logits_cache else length - 1
    assert final.report.usage.cached_tokens == reused and final.report.usage.computed_tokens == length - reused
    prefix = final.report.cache.prefix
    assert prefix.num_tokens == reused and dict(prefix.tiers) == {"device": reused}
    assert h.engine.num_steps - steps == (7 if logits_cache else 8)  # 8 tokens: the first needs no pass
    assert final.report.cache.is_exact


def test_shared_prefix_then_new_question_reuses_up_to_the_divergence(harness):
    h = harness(block_size=8)
    document = h.ids(TEXT)[:45]
    first = token_plan(h.plain, document + h.ids(" Who sleeps?"))
    second = token_plan(h.plain, document + h.ids(" Where does the river flow?"))
    h.run_sync(first, _greedy())
    tokens, final = h.run_sync(second, _greedy())
    assert tokens[0] == h.oracle(second, _greedy())
    common = next(i for i, (a, b) in enumerate(zip(first.new_token_ids(), second.new_token_ids())) if a != b)
    # Token-exact: the block that straddles the divergence donates its common prefix.
    assert final.report.usage.cached_tokens == common
    assert final.report.usage.computed_tokens == len(second.new_token_ids()) - common


def test_next_turn_reuses_the_generated_reply(harness):
    h = harness(block_size=8)
    prompt = h.ids(TEXT)[:30]
    reply, _ = h.run_sync(token_plan(h.plain, prompt), _greedy(max_tokens=12))
    follow = prompt + tuple(reply[0]) + h.ids(" And then?")
    plan = token_plan(h.plain, follow)
    tokens, final = h.run_sync(plan, _greedy())
    assert tokens[0] == h.oracle(plan, _greedy())
    # The prompt and every generated token but the last (never fed, so it has no KV) are reused.
    assert final.report.usage.cached_tokens == len(prompt) + len(reply[0]) - 1


def test_n_samples_and_concurrent_identical_prompts(harness):
    h = harness(block_size=8)
    plan = token_plan(h.plain, h.ids(TEXT)[:50])
    want = h.oracle(plan, _greedy())

    async def both():
        return await asyncio.gather(h.run(plan, _greedy(n=3)), h.run(plan, _greedy()))

    (multi, _), (single, _) = asyncio.run(both())
    assert [multi[i] for i in range(3)] == [want] * 3 and single[0] == want
    again, final = h.run_sync(plan, _greedy(n=2))
    assert [again[0], again[1]] == [want, want] and final.report.usage.cached_tokens == 50  # logits cached
    assert h.engine.scheduler.memory.used_bytes == 0


def test_pml_new_text_is_reused_after_the_same_modules_only(harness):
    h = harness(block_size=8)
    question = " ".join(["Which of the documents mention animals, and what do they say about them?"] * 2)
    prompt = f'<prompt schema="lib"><user><d0/><d2/>{question}</user><assistant/></prompt>'
    plan = h.runtime.plan(prompt)
    want = h.oracle(plan, _greedy())
    h.run_sync(plan, _greedy())
    tokens, final = h.run_sync(h.runtime.plan(prompt), _greedy())
    assert tokens[0] == want
    assert final.report.usage.cached_tokens == plan.num_cached_tokens + plan.num_new_tokens  # logits cached
    other = h.runtime.plan(prompt.replace("<d2/>", "<d3/>"))
    tokens, final = h.run_sync(other, _greedy())
    assert tokens[0] == h.oracle(other, _greedy())
    assert final.report.cache.prefix is None  # the same text after other modules attends to other KV


def test_salt_isolates_prefix_blocks(harness):
    h = harness(block_size=8)
    plan = token_plan(h.plain, h.ids(TEXT)[:40])
    h.run_sync(plan, _greedy(), salt="tenant-a")
    _, other = h.run_sync(plan, _greedy(), salt="tenant-b")
    _, unsalted = h.run_sync(plan, _greedy())
    _, same = h.run_sync(plan, _greedy(), salt="tenant-a")
    assert other.report.cache.prefix is None and unsalted.report.cache.prefix is None
    assert same.report.usage.cached_tokens == 40  # every token, the last one's logits cached under tenant-a


def test_prefix_reuse_off_computes_everything(harness):
    h = harness(block_size=0)
    plan = token_plan(h.plain, h.ids(TEXT)[:40])
    h.run_sync(plan, _greedy())
    _, final = h.run_sync(plan, _greedy())
    assert final.report.cache.prefix is None and final.report.usage.computed_tokens == 40


def test_eviction_under_small_budgets_keeps_answers_right(harness):
    per_block = make_tiny_runtime("llama").loaded.kv_bytes_per_token * 8 + 64
    store = build_store(StoreConfig(device_max_bytes=6 * per_block, host_max_bytes=6 * per_block))
    h = harness(block_size=8, store=store)
    ids = h.ids(TEXT)
    plans = [token_plan(h.plain, h.ids(f"Prompt number {i}: ") + ids[: 30 + i]) for i in range(8)]
    for plan in [*plans, *plans]:
        tokens, _ = h.run_sync(plan, _greedy(max_tokens=4))
        assert tokens[0] == h.oracle(plan, _greedy(max_tokens=4))
        for tier in store.tiers:
            assert tier.used_bytes <= tier.max_bytes
    _, final = h.run_sync(plans[-1], _greedy(max_tokens=4))
    assert final.report.usage.cached_tokens > 0  # the most recent prompt is still (partly) resident


def test_logits_with_reuse_equal_full_prefill(harness):
    """The fp32 oracle: one model forward over the whole sequence; reuse must not move the logits."""
    h = harness(block_size=8)
    ids = h.ids(TEXT)[:37]
    h.run_sync(token_plan(h.plain, ids), _greedy())
    model = h.runtime.loaded.model
    with torch.inference_mode():
        full = model(torch.tensor([ids], device=model.device),
                     attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=model.device)).logits[0, -1]
    full = full.float().cpu()  # the oracle on the host: cached logits live there, step logits are moved
    # The engine's own components, driven step by step on this thread (no engine thread involved),
    # without the logits cache so the last token is computed over the reused KV.
    cached = h.engine.prefix.logits.get(h.engine.prefix._terminal_key(
        h.engine.prefix.open([], list(ids), list(range(len(ids))), salt=None), None))
    assert cached is not None and torch.allclose(cached.cpu(), full, atol=1e-4)  # cached logits: exact too
    prefix = PrefixReuse(h.engine.prefix.index)
    scheduler = Scheduler(h.engine.config, h.runtime.module_encoder, prefix)
    runner = ModelRunner(h.runtime.loaded)
    scheduler.add(Request("probe", token_plan(h.plain, ids), SamplingParams(max_tokens=1, temperature=0), None))
    step = scheduler.schedule()
    [entry] = step.batch
    assert entry.seq.request.stream.num_reused == 36 and entry.seq.pending_ids == [ids[-1]] and entry.num_tokens == 1
    output = runner.run(step)
    assert torch.allclose(output.logits[0].cpu(), full, atol=1e-4)
    events = OutputProcessor(scheduler, prefix).postprocess(step, output).events
    assert events[-1].report.usage.cached_tokens == 36 and scheduler.memory.used_bytes == 0
