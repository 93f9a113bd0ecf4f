"""Driving the engine in tests: a whole engine for one request, one prefill step on the test's thread, one pass."""

from __future__ import annotations

import asyncio

import torch

from promptcache.model_runtime import SamplingParams
from promptcache.model_runtime.engine import Engine, EngineConfig, Fidelity, TokenEvent, resolve
from promptcache.model_runtime.engine.encoding import encode_now
from promptcache.model_runtime.engine.outputs import OutputProcessor
from promptcache.model_runtime.engine.prefix import PrefixReuse
from promptcache.model_runtime.engine.request import Request
from promptcache.model_runtime.engine.runner import ModelRunner
from promptcache.model_runtime.engine.scheduler import Scheduler
from promptcache.model_runtime.engine.step_plan import ScheduledSeq


def first_step(runtime, plan, fidelity: Fidelity | None = None, *, prefix: PrefixReuse | None = None,
               reuse=None) -> tuple[torch.Tensor, TokenEvent]:
    """The first token's logits [vocab] and the final event of `plan` served with max_tokens=1 (`reuse`:
    a ReusePlan given instead of the fidelity's own). Module KV it lacks (a second encoding) is encoded
    first."""
    fidelity = fidelity or Fidelity()
    jobs = [(u.cached.segment.segment_id, tuple(u.cached.context_ids)) for u in (reuse or resolve(plan, fidelity)).uses]
    runner = ModelRunner(runtime.loaded)
    encode_now(runtime.module_encoder, runner, plan.schema, jobs)
    prefix = prefix or PrefixReuse(None)
    scheduler = Scheduler(EngineConfig(prefix=None), runtime.module_encoder, prefix)
    request = Request("probe", plan, SamplingParams(max_tokens=1, temperature=0), None, fidelity)
    request.reuse = reuse
    scheduler.add(request)
    step = scheduler.schedule()
    assert not step.events and not step.encodes and len(step.batch) == 1, step
    output = runner.run(step)
    result = OutputProcessor(scheduler, prefix).postprocess(step, output)
    return output.logits[0], result.events[-1]


def engine_tokens(runtime, plan, params: SamplingParams, **config) -> list[int]:
    """`plan`'s tokens (sample 0) from an engine of its own, `EngineConfig(prefix=None, **config)`."""
    engine = Engine(runtime.module_encoder, EngineConfig(**{"prefix": None, **config}))

    async def main() -> list[int]:
        tokens = []
        async for event in engine.submit(plan, params):
            assert event.report is None or event.report.error is None, event.report
            tokens += [event.token_id] if event.index == 0 and event.token_id is not None else []
        return tokens

    try:
        return asyncio.run(main())
    finally:
        engine.stop()


def feed(runner: ModelRunner, seqs: list) -> torch.Tensor:
    """One pass feeding every pending token of `seqs`, which then advance; their logits [num_seqs, vocab]."""
    entries = [ScheduledSeq(seq, len(seq.pending_ids)) for seq in seqs]
    logits, _ = runner.forward(entries)
    for entry in entries:
        entry.seq.advance(entry.num_tokens)
    return logits
