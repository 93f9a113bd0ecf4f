"""The step's batch across tenants: lightly loaded tenants' prompts first, a step of their own for a
short prompt while another tenant decodes, and sequence slots one tenant leaves free for the others."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from promptcache.model_runtime import SamplingParams
from promptcache.model_runtime.engine import Engine, EngineConfig
from promptcache.model_runtime.engine import scheduler as scheduler_module
from promptcache.model_runtime.engine.request import SeqStatus
from promptcache.model_runtime.engine.step_budget import SharedStepCap
from promptcache.model_runtime.engine.step_plan import compose_step
from tests.model_runtime.oracles import reference_tokens
from tests.model_runtime.test_scheduler import TEXTS, _run, _runtime, _text_plan


@dataclass
class _Req:
    tenant: str | None


@dataclass
class _Seq:
    """The fields of a running sequence the batch policy reads."""

    tenant: str | None
    num_pending: int
    status: SeqStatus
    request: _Req = field(init=False)
    pending_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.request = _Req(self.tenant)
        self.pending_ids = [0] * self.num_pending


def _decoding(tenant):
    return _Seq(tenant, 1, SeqStatus.DECODE)


def _prefill(tenant, num_tokens):
    return _Seq(tenant, num_tokens, SeqStatus.PREFILL)


def _fed(batch) -> list[tuple[_Seq, int]]:
    return [(entry.seq, entry.num_tokens) for entry in batch]


def test_one_tenant_shares_the_budget_in_admission_order():
    decodes = [_decoding(None) for _ in range(3)]
    first, second = _prefill(None, 20), _prefill(None, 40)
    batch, left = compose_step([*decodes, first, second], mixed_budget=30, alone_budget=256)
    assert _fed(batch) == [*((d, 1) for d in decodes), (first, 20), (second, 10)] and left == 0


def test_a_prompt_within_half_the_budget_of_its_end_is_finished_in_the_step():
    """Beside decodes, a question is not split into a chunk and a tail of a few tokens that would wait a whole step
    more for its first token; a longer rest is still chunked, and so is every prompt under a row cap."""
    decodes = [_decoding(None) for _ in range(3)]
    first, second = _prefill(None, 20), _prefill(None, 25)  # 10 of the budget left for 25: 15 over, = budget // 2
    batch, left = compose_step([*decodes, first, second], mixed_budget=30, alone_budget=256)
    assert _fed(batch) == [*((d, 1) for d in decodes), (first, 20), (second, 25)] and left == 0
    longer = _prefill(None, 26)
    batch, _ = compose_step([*decodes, first, longer], mixed_budget=30, alone_budget=256)
    assert _fed(batch)[-1] == (longer, 10)
    batch, _ = compose_step([*decodes, first, second], mixed_budget=30, alone_budget=256, max_rows=64)
    assert _fed(batch)[-1] == (second, 10)


def test_a_light_tenants_short_prompt_gets_a_step_of_its_own():
    busy = [_decoding("a") for _ in range(8)] + [_prefill("a", 50)]
    light = _prefill("b", 12)
    batch, left = compose_step([*busy, light], mixed_budget=16, alone_budget=256)
    assert _fed(batch) == [(light, 12)] and left == 244


def test_a_light_tenants_long_prompt_is_chunked_but_fed_first():
    busy_decodes = [_decoding("a") for _ in range(8)]
    busy_prefill, light = _prefill("a", 50), _prefill("b", 300)
    batch, left = compose_step([*busy_decodes, busy_prefill, light], mixed_budget=16, alone_budget=256)
    assert _fed(batch) == [*((d, 1) for d in busy_decodes), (light, 16)] and left == 0


def test_with_nothing_decoding_the_less_loaded_tenant_is_fed_first():
    a_prefills = [_prefill("a", 100) for _ in range(3)]
    b_prefill = _prefill("b", 100)
    batch, left = compose_step([*a_prefills, b_prefill], mixed_budget=16, alone_budget=150)
    assert _fed(batch) == [(b_prefill, 100), (a_prefills[0], 50)] and left == 0


def test_headroom_lets_another_tenant_start_before_the_first_ones_batch_drains(engines):
    """Tenant a fills every slot it may take with long generations; b's request, sent once a's run,
    finishes long before any of a's. Without headroom b waits for a's batch to finish first (the step
    limit off: it would let a's decodes take turns, and they would finish one by one)."""
    runtime = _runtime()
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    a_plans = [_text_plan(runtime, TEXTS[i % len(TEXTS)]) for i in range(6)]
    b_plan = _text_plan(runtime, TEXTS[4])

    def finish_order(headroom: int) -> tuple[list[str], list[list[int]]]:
        engine = Engine(runtime.module_encoder, EngineConfig(max_num_seqs=4, tenant_headroom_seqs=headroom,
                                                             prefix=None, shared_step_ratio=None))
        log: list = []

        async def main():
            with engine.inbox.wakeup:  # a's requests reach the engine together: a's first batch is full
                a_streams = [engine.submit(plan, long, tenant="a") for plan in a_plans]
            tasks = [asyncio.create_task(_run(s, log, f"a{i}")) for i, s in enumerate(a_streams)]
            while ("a0", "token") not in log:  # a's first batch runs
                await asyncio.sleep(0.005)
            tasks.append(asyncio.create_task(_run(engine.submit(b_plan, short, tenant="b"), log, "b")))
            return await asyncio.gather(*tasks)

        try:
            results = asyncio.run(main())
        finally:
            engine.stop()
        return [name for name, kind in log if kind == "final"], results

    finished, results = finish_order(headroom=1)
    assert finished[0] == "b", finished
    expected = [reference_tokens(runtime.loaded, plan, long) for plan in a_plans]
    assert results == [*expected, reference_tokens(runtime.loaded, b_plan, short)]
    finished, _ = finish_order(headroom=0)
    assert finished.index("b") >= 4, finished  # the oracle: no headroom, b waits for a's first batch


def test_long_prefill_chunks_only_while_a_tenant_with_nothing_running_waits(engines, monkeypatch):
    """A tenant's own backlog keeps the long chunks of a prompt fed alone (its throughput); another
    tenant waiting with nothing running caps them, so its first token is not held behind them."""
    runtime = _runtime()
    budgets: list[int] = []

    def recording(running, **kwargs):
        budgets.append(kwargs["alone_budget"])
        return compose_step(running, **kwargs)

    monkeypatch.setattr(scheduler_module, "compose_step", recording)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    plans = [_text_plan(runtime, text) for text in TEXTS]

    def run(tenants: list[str]) -> list[list[int]]:
        return _run_at_once(runtime, EngineConfig(max_num_seqs=1, max_prefill_tokens=4, max_prefill_tokens_alone=64,
                                                  prefix=None), plans, params, tenants)

    one_tenant = run(["a", "a", "a"])
    assert budgets and set(budgets) == {64}
    budgets.clear()
    two_tenants = run(["a", "a", "b"])
    assert 4 in budgets  # b waited with nothing running
    expected = [reference_tokens(runtime.loaded, plan, params) for plan in plans[:3]]
    assert one_tenant == two_tenants == expected


def _run_at_once(runtime, config: EngineConfig, plans, params: SamplingParams, tenants: list[str]) -> list[list[int]]:
    """Submit `plans[i]` for each `tenants[i]` so that one schedule sees them all; their token ids."""
    engine = Engine(runtime.module_encoder, config)

    async def main():
        with engine.inbox.wakeup:
            streams = [engine.submit(plans[i], params, tenant=t) for i, t in enumerate(tenants)]
        return await asyncio.gather(*[_run(s, [], "") for s in streams])

    try:
        return asyncio.run(main())
    finally:
        engine.stop()


def test_under_a_row_cap_lighter_tenants_decode_first_and_prompts_keep_a_floor():
    heavy = [_decoding("a") for _ in range(10)]
    light = [_decoding("b")]
    waiting = _prefill("a", 50)
    batch, left = compose_step([*heavy, *light, waiting], mixed_budget=40, alone_budget=256, max_rows=6, min_tokens=2)
    assert _fed(batch) == [(light[0], 1), *((d, 1) for d in heavy[:3]), (waiting, 2)] and left == 0
    batch, _ = compose_step([*heavy, *light], mixed_budget=40, alone_budget=256, max_rows=6, min_tokens=2)
    assert _fed(batch) == [(light[0], 1), *((d, 1) for d in heavy[:5])]  # nothing waits: all rows decode


def test_a_busy_tenants_steps_are_capped_once_a_light_tenant_got_a_step(monkeypatch):
    """Tenant a decodes six long generations; b's short prompt gets a step of its own, and from then
    on a's steps run at most the cap's rows (its decodes taking turns). Every answer is still the
    reference's; with one tenant nothing is capped."""
    runtime = _runtime()
    monkeypatch.setattr(SharedStepCap, "cap", lambda self: 3)
    steps: list[tuple[int | None, int, int]] = []  # (max_rows, rows fed, sequences decoding)

    def recording(running, **kwargs):
        batch, left = compose_step(running, **kwargs)
        decoding = sum(1 for s in running if s.status != SeqStatus.PREFILL)
        steps.append((kwargs["max_rows"], sum(e.num_tokens for e in batch), decoding))
        return batch, left

    monkeypatch.setattr(scheduler_module, "compose_step", recording)
    long = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    a_plans = [_text_plan(runtime, TEXTS[i % len(TEXTS)]) for i in range(6)]
    b_plan = _text_plan(runtime, TEXTS[4])
    engine = Engine(runtime.module_encoder, EngineConfig(max_num_seqs=8, prefix=None))

    async def main(with_b: bool):
        log: list = []
        tasks = [asyncio.create_task(_run(engine.submit(plan, long, tenant="a"), log, f"a{i}"))
                 for i, plan in enumerate(a_plans)]
        if with_b:
            while sum(1 for _, kind in log if kind == "token") < 12:  # a's batch decodes
                await asyncio.sleep(0.002)
            tasks.append(asyncio.create_task(_run(engine.submit(b_plan, short, tenant="b"), log, "b")))
        return await asyncio.gather(*tasks)

    try:
        alone = asyncio.run(main(with_b=False))
        assert all(max_rows is None for max_rows, _, _ in steps)
        steps.clear()
        shared = asyncio.run(main(with_b=True))
    finally:
        engine.stop()
    capped = [(rows, decoding) for max_rows, rows, decoding in steps if max_rows is not None]
    assert any(decoding > 3 for _, decoding in capped)  # the cap left decodes out
    assert all(rows <= 3 for rows, _ in capped)
    expected = [reference_tokens(runtime.loaded, plan, long) for plan in a_plans]
    assert alone == shared[:6] == expected and shared[6] == reference_tokens(runtime.loaded, b_plan, short)
