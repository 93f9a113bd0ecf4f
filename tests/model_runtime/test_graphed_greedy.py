"""Greedy picks from a graphed step's in-graph argmax, on the CPU (StaticForward run eagerly in the runner's place of
the CUDA graphs): a step whose every row takes only the argmax hands the runner's RunOutput its argmax, and the
output processor takes those tokens (no sampler pass), equal to the sampler's greedy tokens over the eager logits;
a row sampled, asking for logprobs, or finishing a prompt sends the step through the sampler as before."""

from __future__ import annotations

import pytest
import torch

from promptcache.model_runtime import SamplingParams
from promptcache.model_runtime.engine import outputs
from promptcache.model_runtime.engine.cuda_graphs import GraphedSteps
from promptcache.model_runtime.engine.outputs import OutputProcessor
from promptcache.model_runtime.engine.request import SeqStatus
from promptcache.model_runtime.engine.runner import ModelRunner
from promptcache.model_runtime.engine.step_plan import ScheduledSeq, StepPlan
from promptcache.model_runtime.sampling import Sampler, sample_batch
from tests.model_runtime.test_static_step import _loaded, _sequences, _twins

GREEDY = SamplingParams(temperature=0)


def _runner(loaded) -> ModelRunner:
    """A runner whose uniform steps go through StaticForward run eagerly (what a GPU replays from a graph)."""
    runner = ModelRunner(loaded)
    runner.graphs = GraphedSteps(loaded.model, backend="auto", max_num_seqs=8, use_graphs=False)
    return runner


def _with_samplers(seqs, params):
    for seq, p in zip(seqs, params):
        seq.sampler = Sampler(p)
    return seqs


def _draw(samples, output, monkeypatch):
    """OutputProcessor._draw over the run's rows (no scheduler needed); returns (draws, sampler calls)."""
    calls = []

    def counting(samplers, logits, rows=None):
        calls.append(len(samplers))
        return sample_batch(samplers, logits, rows)

    monkeypatch.setattr(outputs, "sample_batch", counting)
    processor = object.__new__(OutputProcessor)
    return processor._draw(samples, output.logits, output.greedy_ids), calls


def test_all_greedy_steps_take_the_graphs_argmax(monkeypatch):
    loaded = _loaded()
    seqs = _with_samplers(_sequences(loaded, 5), [GREEDY] * 5)
    twins = _twins(seqs)
    expected, _ = ModelRunner(loaded).forward([ScheduledSeq(s, 1) for s in twins])  # eager logits [5, vocab]
    oracle = sample_batch([Sampler(GREEDY) for _ in range(5)], expected)

    output = _runner(loaded).run(StepPlan(batch=tuple(ScheduledSeq(s, 1) for s in seqs), prefill_budget=0))
    assert output.greedy_ids is not None and output.greedy_ids.shape == (5,)
    draws, calls = _draw([(s, row) for row, s in enumerate(seqs)], output, monkeypatch)
    assert calls == []  # the sampler never ran: the graph's argmax was taken
    assert [d.token_id for d in draws] == [d.token_id for d in oracle]
    assert all(d.logprobs is None and d.error is None for d in draws)


@pytest.mark.parametrize("odd", [SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=0, logprobs=2),
                                 SamplingParams(temperature=0, repetition_penalty=1.3)],
                         ids=["sampled", "logprobs", "penalty"])
def test_a_row_wanting_more_than_the_argmax_goes_through_the_sampler(odd, monkeypatch):
    loaded = _loaded()
    params = [GREEDY, odd, GREEDY]
    seqs = _with_samplers(_sequences(loaded, 3), params)
    twins = _with_samplers(_twins(seqs), params)
    expected, _ = ModelRunner(loaded).forward([ScheduledSeq(s, 1) for s in twins])
    oracle = sample_batch([s.sampler for s in twins], expected)

    output = _runner(loaded).run(StepPlan(batch=tuple(ScheduledSeq(s, 1) for s in seqs), prefill_budget=0))
    assert output.greedy_ids is None
    torch.testing.assert_close(output.logits, expected, rtol=1e-5, atol=1e-5)
    draws, calls = _draw([(s, row) for row, s in enumerate(seqs)], output, monkeypatch)
    assert calls == [3]
    assert [d.token_id for d in draws] == [d.token_id for d in oracle]
    assert (draws[1].logprobs is None) == (odd.logprobs is None)


def test_a_prompts_last_chunk_keeps_its_logits():
    """A graphed lone prefill: the runner copies its logits (kept for exact repeats), no argmax handed on."""
    loaded = _loaded()
    seqs = _with_samplers(_sequences(loaded, 1, num_new=7, prefill=True), [GREEDY])
    assert seqs[0].status == SeqStatus.PREFILL
    output = _runner(loaded).run(StepPlan(batch=(ScheduledSeq(seqs[0], 7),), prefill_budget=0))
    assert output.greedy_ids is None and output.logits.shape[0] == 1
