"""Host syncs of a sampling step, counted: the meta device stands in for a GPU (a value read back from it cannot be
computed, so every read is an op a dispatch mode sees), for the sampler alone and for the engine's postprocess."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from promptcache.model_runtime.engine import EngineConfig
from promptcache.model_runtime.engine.outputs import OutputProcessor
from promptcache.model_runtime.engine.prefix import PrefixReuse
from promptcache.model_runtime.engine.request import Request
from promptcache.model_runtime.engine.runner import ModelRunner, RunOutput
from promptcache.model_runtime.engine.scheduler import Scheduler
from promptcache.model_runtime.sampling import PromptTokens, Sampler, SamplingParams, sample_batch
from promptcache.pml import token_plan
from tests.conftest import make_tiny_runtime
from tests.model_runtime.sampling_reference import ReferenceSampler, reference_logprobs

aten = torch.ops.aten
VOCAB = 64
# Greedy, plain and penalised; seeded with every warper; unseeded; penalised and biased; logprobs.
MIXED = [SamplingParams(temperature=0), SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=2),
         SamplingParams(temperature=0.8, top_k=9, top_p=0.9, min_p=0.05, seed=1),
         SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.2, seed=2, logprobs=0),
         SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, logit_bias=((3, 4.0),), seed=3)]


class HostReads(TorchDispatchMode):
    """Counts reads of meta tensors by the host: `.item()`/`bool()`/`int()` (aten._local_scalar_dense) and copies
    to the CPU (`.cpu()`, `.tolist()`), answered with `fill` so the host's half of the code runs on."""

    def __init__(self, fill: float = 0.0) -> None:
        super().__init__()
        self.fill, self.count = fill, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func is aten._local_scalar_dense.default and source is not None and source.is_meta:
            self.count += 1
            return True if source.dtype == torch.bool else type(self.fill)(self.fill)
        if func is aten._to_copy.default and source is not None and source.is_meta \
                and torch.device(kwargs.get("device") or "meta").type == "cpu":
            self.count += 1
            return torch.full(source.shape, self.fill, dtype=kwargs.get("dtype") or source.dtype)
        return func(*args, **kwargs)


def _samplers(cls):
    return [cls(p, seed_offset=i, prompt=PromptTokens([1, 5, 9])) for i, p in enumerate(MIXED)]


def test_a_mixed_step_reads_back_once_and_never_syncs_on_the_device():
    samplers = _samplers(Sampler)
    for step in range(3):  # the first step, then steps with recorded tokens to count
        logits = torch.randn(len(MIXED), VOCAB, device="meta")
        with HostReads() as reads:
            draws = sample_batch(samplers, logits)
        assert reads.count == 1, step
        assert len(draws) == len(MIXED) and all(d.error is None for d in draws)
    assert all(s.counts is None or s.counts.is_meta for s in samplers)  # penalty state stayed on the device


def test_the_per_sequence_sampler_synced_per_row():
    """The count above can fail: the sampler it replaced read back per row (a torch.tensor of the unseen tokens
    per penalised row, a copy the other way, comes on top from the second step)."""
    samplers = _samplers(ReferenceSampler)
    logits = torch.randn(len(MIXED), VOCAB, device="meta")
    with HostReads(fill=1.0) as reads:
        argmax = logits.argmax(dim=-1).tolist()  # the engine's one argmax for plain greedy rows
        for sampler, row, best in zip(samplers, logits, argmax):
            params = sampler.params
            token = sampler.take(best) if params.is_plain_greedy else sampler.sample(row)
            if params.logprobs is not None:
                reference_logprobs(row, token, params.logprobs)
    # The batch argmax 1; the penalised greedy row's argmax 1; isfinite and probs.cpu() per sampled row 2 x 4;
    # each logprob row's logprob and two lists 3 x 2.
    assert reads.count == 1 + 1 + 2 * 4 + 3 * 2


def test_the_engine_postprocess_reads_back_once_per_step():
    """A prefill step forking n = 2 samples with mixed parameters, then a decode step: OutputProcessor reads the
    step's logits (here moved to the meta device) back once each step."""
    runtime = make_tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema('<schema name="plain"/>'), encode=False)
    plan = token_plan(runtime.get_schema("plain"), tuple(range(5, 17)))
    prefix = PrefixReuse(None)
    scheduler = Scheduler(EngineConfig(prefix=None), runtime.module_encoder, prefix)
    for i, params in enumerate(MIXED):
        forked = SamplingParams(**{**_fields(params), "n": 2, "max_tokens": 4, "ignore_eos": True})
        scheduler.add(Request(f"r{i}", plan, forked, None))
    runner, outputs = ModelRunner(runtime.loaded), OutputProcessor(scheduler, prefix)
    for step in range(2):
        plan_step = scheduler.schedule()
        ran = runner.run(plan_step)
        assert len(ran.ran) == len(MIXED) * (1 + step)  # the prompts, then their samples
        on_meta = RunOutput(ran.ran, ran.logits.to("meta"), ran.prompt_logprobs, ran.failures, step_ms=ran.step_ms)
        with HostReads() as reads:
            result = outputs.postprocess(plan_step, on_meta)
        assert reads.count == 1, step
        assert sum(e.token_id is not None for e in result.events) == 2 * len(MIXED)  # picks of 0: fed next


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in SamplingParams.__dataclass_fields__}
