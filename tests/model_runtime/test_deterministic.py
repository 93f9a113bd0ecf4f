"""Deterministic serving (model_runtime/deterministic/) end to end: with it on, a request's tokens and logprobs are the
same bits cold (its prompt computed), warm (its prompt reused from the prefix cache, its first logits cached), in
chunks of a few tokens, with prompt logprobs (every token computed), and among 16 concurrent requests; greedy and
seeded (temperature 0.9, n=3), fp32 and bf16, plain prompts and PML prompts over cached modules.

Oracle: the same request alone on a fresh engine. Also: each combination it refuses, named at load."""

from __future__ import annotations

import asyncio

import pytest
import torch

from promptcache.cache_store import BlockIndexConfig, StoreConfig, build_store
from promptcache.model_runtime import (
    ModelConfig,
    ModelLoadError,
    ModelRuntime,
    SamplingParams,
    WeightFormat,
    load_model,
    wrap_model,
)
from promptcache.model_runtime import deterministic as determinism
from promptcache.model_runtime.baseline import full_prefill_logits
from promptcache.model_runtime.engine import Engine, EngineConfig
from promptcache.pml import token_plan
from tests.model_factories import make_test_tokenizer, make_tiny_model
from tests.model_runtime.engine_probe import first_step
from tests.model_runtime.test_engine import SCHEMA
from tests.model_runtime.test_smollm2_exactness import PROMPT as AMAZON_PROMPT
from tests.model_runtime.test_smollm2_exactness import SCHEMA as AMAZON_SCHEMA

DOCUMENT = ("The quick brown fox jumps over the lazy dog. Cats sleep most of the day, and tea is brewed with hot "
            "water. Rome was not built in a day. The river flows north through the valley. ") * 2
QUESTIONS = ("Who sleeps?", "Where does the river flow?", "What is brewed?", "Was Rome built in a day?",
             "Which animal jumps?", "What flows north?", "Who is lazy?", "What is hot?")
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, n=3, seed=7, ignore_eos=True, logprobs=2)


def _loaded(arch: str, dtype: torch.dtype):
    tokenizer = make_test_tokenizer()
    return wrap_model(make_tiny_model(arch, vocab_size=len(tokenizer), dtype=dtype), tokenizer, name=f"tiny-{arch}",
                      deterministic=True)


class Harness:
    """A deterministic tiny model's runtime (a plain schema and the documents schema) and an engine over it."""

    def __init__(self, loaded, **engine) -> None:
        self.runtime = ModelRuntime(loaded, build_store(StoreConfig()))
        self.runtime.add_schema(self.runtime.parse_schema('<schema name="plain"/>'), encode=False)
        self.runtime.add_schema(self.runtime.parse_schema(SCHEMA))
        self.engine = Engine(self.runtime.module_encoder, EngineConfig(prefix=BlockIndexConfig(block_size=8), **engine))

    def plans(self) -> list:
        """16 prompts: plain ones sharing the document, PML ones over the cached documents."""
        tokenizer = self.runtime.loaded.tokenizer
        plain = self.runtime.get_schema("plain")
        plans = [token_plan(plain, tuple(tokenizer.encode(f"{DOCUMENT} {q}", add_special_tokens=False)))
                 for q in QUESTIONS]
        modules = ["<d0/><d2/>", "<d1/><d3/>", "<d0/><d1/><d4/>", "<d2/>"]
        return plans + [self.runtime.plan(f'<prompt schema="lib"><user>{modules[i % 4]}{q}</user><assistant/></prompt>')
                        for i, q in enumerate(QUESTIONS)]

    async def run(self, plan, params: SamplingParams) -> dict[int, list]:
        """Per sample: its (token, logprob, top alternatives) in order."""
        samples: dict[int, list] = {}
        async for event in self.engine.submit(plan, params):
            assert event.report is None or event.report.error is None, event.report
            if event.token_id is not None:
                samples.setdefault(event.index, []).append((event.token_id, event.logprobs))
        return samples

    def alone(self, plan, params: SamplingParams) -> dict[int, list]:
        return asyncio.run(self.run(plan, params))

    def together(self, plans, params: SamplingParams) -> list[dict[int, list]]:
        async def main():
            return await asyncio.gather(*(self.run(plan, params) for plan in plans))

        return asyncio.run(main())


@pytest.fixture
def harness(engines, deterministic_kernels):
    return lambda loaded, **engine: engines(Harness, loaded=loaded, **engine)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize(("arch", "dtype"), [("llama", torch.float32), ("llama", torch.bfloat16),
                                             ("qwen2", torch.float32), ("qwen3", torch.float32),
                                             ("phi3", torch.float32)])
def test_cold_warm_chunked_and_batched_answers_are_the_same_bits(harness, arch, dtype, params):
    loaded = _loaded(arch, dtype)
    alone = harness(loaded)
    plans = alone.plans()
    cold = [alone.alone(plan, params) for plan in plans]
    warm = [alone.alone(plan, params) for plan in plans]  # prefix blocks and cached logits
    assert warm == cold
    assert all(len(samples) == params.n and all(len(s) == 8 for s in samples.values()) for samples in cold)
    chunked = harness(loaded, max_prefill_tokens=5, max_prefill_tokens_alone=5, min_prefill_tokens=1)  # 5 a step
    assert [chunked.alone(plan, params) for plan in plans[::3]] == cold[::3]
    batched = harness(loaded)
    assert batched.together(plans, params) == cold
    assert batched.together(plans[::-1], params) == cold[::-1]  # now warm, in another order


def test_prompt_logprobs_computing_every_token_change_no_answer(harness):
    loaded = _loaded("llama", torch.float32)
    h = harness(loaded)
    plan = h.plans()[0]
    cold = h.alone(plan, SEEDED)
    with_prompt = SamplingParams(**{**{f: getattr(SEEDED, f) for f in SEEDED.__dataclass_fields__},
                                    "prompt_logprobs": 1})
    assert h.alone(plan, with_prompt) == cold  # the prompt recomputed in full despite its cached blocks


def test_refused_combinations_are_named_at_load():
    tokenizer = make_test_tokenizer()
    with pytest.raises(ModelLoadError, match="int8"):
        wrap_model(make_tiny_model("llama", vocab_size=len(tokenizer)), tokenizer, name="m", deterministic=True,
                   weights=WeightFormat.INT8)
    with pytest.raises(ModelLoadError, match="gpt2"):
        wrap_model(make_tiny_model("gpt2", vocab_size=len(tokenizer)), tokenizer, name="m", deterministic=True)
    config = make_tiny_model("llama", vocab_size=len(tokenizer)).config
    assert "CPU only" in determinism.problem(config, torch.float32, "cuda:0", "native")
    assert "float16" in determinism.problem(config, torch.float16, "cpu", "native")
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert "rescales with the sequence length" in determinism.problem(config, torch.float32, "cpu", "native")


def test_deterministic_kv_has_keys_of_its_own(deterministic_kernels):
    tokenizer = make_test_tokenizer()
    default = wrap_model(make_tiny_model("llama", vocab_size=len(tokenizer)), tokenizer, name="tiny-llama")
    assert _loaded("llama", torch.float32).model_fingerprint != default.model_fingerprint


@pytest.fixture(scope="module")
def deterministic_smollm2(deterministic_kernels):
    """The real default model (SmolLM2-135M-Instruct, fp32) laid out for deterministic serving."""
    return load_model(ModelConfig(deterministic=True))


def test_the_default_model_answers_as_its_full_prefill_and_the_same_bits_however_served(
        engines, deterministic_smollm2, smollm2):
    runtime = ModelRuntime(deterministic_smollm2, build_store(StoreConfig()))
    runtime.add_schema(runtime.parse_schema(AMAZON_SCHEMA))
    plan = runtime.plan(AMAZON_PROMPT)
    logits, _ = first_step(runtime, plan)
    reference = full_prefill_logits(smollm2.model, plan.token_ids(), plan.position_ids())[-1]  # the default model
    assert (logits - reference).abs().max().item() <= 1e-3
    h = engines(Harness, loaded=deterministic_smollm2)
    plans = h.plans()[:: 4]  # two plain, two PML prompts
    cold = [h.alone(plan, SEEDED) for plan in plans]
    assert [h.alone(plan, SEEDED) for plan in plans] == cold
    assert engines(Harness, loaded=deterministic_smollm2).together(plans, SEEDED) == cold
