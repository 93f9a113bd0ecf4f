"""Exactness on the real SmolLM2-135M-Instruct with its ChatML chat template."""

from __future__ import annotations

from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime, SamplingParams
from promptcache.model_runtime.baseline import full_prefill_greedy, full_prefill_logits
from tests.model_runtime.engine_probe import engine_tokens, first_step

SCHEMA = """<schema name="smol">
  <system>You are a helpful assistant. Answer in one short sentence.</system>
  <user><module name="doc">The Amazon river flows east across South America and empties into the Atlantic
    Ocean. It carries more water than any other river on Earth.</module></user>
</schema>"""
PROMPT = '<prompt schema="smol"><user><doc/>Into which ocean does the Amazon flow?</user><assistant/></prompt>'


def test_the_engines_cached_prefill_equals_full_prefill_on_smollm2(smollm2):
    runtime = ModelRuntime(smollm2, build_store(StoreConfig(), device="cpu"))
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    plan = runtime.plan(PROMPT)
    assert plan.is_exact
    text = smollm2.tokenizer.decode(plan.token_ids())
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert text.endswith("Into which ocean does the Amazon flow?<|im_end|>\n<|im_start|>assistant\n")
    logits, final = first_step(runtime, plan)
    reference = full_prefill_logits(smollm2.model, plan.token_ids(), plan.position_ids())[-1]
    assert (logits - reference).abs().max().item() <= 1e-4 and final.report.cache.is_exact
    tokens = engine_tokens(runtime, plan, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert tokens == full_prefill_greedy(smollm2.model, plan.token_ids(), plan.position_ids(), 20)
    assert "Atlantic" in smollm2.tokenizer.decode(tokens, skip_special_tokens=True)
