"""The engine's cached prefill against oracles: full prefill where exact, an explicit-mask forward where not."""

from __future__ import annotations

import pytest
import torch

from promptcache.model_runtime import SamplingParams
from promptcache.model_runtime.baseline import full_prefill_greedy, full_prefill_logits
from tests.model_runtime.engine_probe import engine_tokens, first_step
from tests.model_runtime.oracles import approximation_reference

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2"]
EXACT_SCHEMA = """<schema name="exact">
  <system>You are a careful assistant who answers briefly.</system>
  <user><module name="doc">The river Nile flows north through eleven countries into the sea.</module></user>
</schema>"""
SCAFFOLD_SCHEMA = """<schema name="scaf">Shared preface for all documents.
  <module name="a">Alpha document: the quick brown fox.</module>
  <module name="b">Beta document: jumps over the lazy dog.</module>
  <module name="c">Gamma document: and runs away.</module>
  <scaffold modules="a b c"/>
</schema>"""
APPROX_SCHEMA = """<schema name="approx" params="{params}">Preface text here.
  <module name="trip">Plan a trip of <param name="days" len="6"/> days to
    <union><module name="miami">Miami with beaches.</module><module name="paris">Paris, the city of light.</module></union>
    and enjoy it.<param name="buffer" len="12"/></module>
  <module name="extra">An extra optional document.</module>
  <module name="last">The last document of all.</module>
</schema>"""  # noqa: E501 (PML text: whitespace matters)
APPROX_PROMPTS = [
    '<prompt schema="approx"><trip days="3"><paris/></trip><last/>What now?</prompt>',
    '<prompt schema="approx"><extra/><last/>Question?</prompt>',
    '<prompt schema="approx"><trip><miami/></trip>in between<extra/>Tail</prompt>',
]


def _check_exact(runtime, prompt: str) -> None:
    plan = runtime.plan(prompt)
    assert plan.is_exact, plan.approximations
    model = runtime.loaded.model
    logits, final = first_step(runtime, plan)
    reference = full_prefill_logits(model, plan.token_ids(), plan.position_ids())[-1]
    assert (logits - reference).abs().max().item() <= 1e-4
    assert final.report.cache.is_exact
    tokens = engine_tokens(runtime, plan, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert tokens == full_prefill_greedy(model, plan.token_ids(), plan.position_ids(), 20)


@pytest.mark.parametrize("arch", ARCHS)
def test_no_optional_parts_is_exact(tiny_runtime, arch):
    runtime = tiny_runtime(arch)
    runtime.add_schema(runtime.parse_schema(EXACT_SCHEMA))
    _check_exact(runtime, '<prompt schema="exact"><user><doc/>Which way does it flow?</user><assistant/></prompt>')


@pytest.mark.parametrize("arch", ARCHS)
def test_fully_imported_scaffold_is_exact(tiny_runtime, arch):
    runtime = tiny_runtime(arch)
    runtime.add_schema(runtime.parse_schema(SCAFFOLD_SCHEMA))
    _check_exact(runtime, '<prompt schema="scaf"><c/><a/><b/>Summarise.</prompt>')


@pytest.mark.parametrize("params", ["placeholder", "skip"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prompt", APPROX_PROMPTS)
def test_approximate_prompts_match_masked_reference(tiny_runtime, arch, prompt, params):
    runtime = tiny_runtime(arch)
    runtime.add_schema(runtime.parse_schema(APPROX_SCHEMA.format(params=params)))
    plan = runtime.plan(prompt)
    assert not plan.is_exact
    logits, final = first_step(runtime, plan)
    tokens, positions, mask = approximation_reference(plan)
    reference = full_prefill_logits(runtime.loaded.model, tokens, positions, attention_mask=mask)[-1]
    assert (logits - reference).abs().max().item() <= 1e-4
    plain = full_prefill_logits(runtime.loaded.model, plan.token_ids(), plan.position_ids())[-1]
    assert (logits - plain).abs().max().item() > 1e-4  # the approximation is real, and visible
    assert final.report.cache.is_exact is False and plan.approximations


def test_bf16_stays_close_to_fp32(tiny_runtime):
    prompt = '<prompt schema="exact"><user><doc/>Which way?</user><assistant/></prompt>'
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        runtime = tiny_runtime("llama", dtype=dtype)
        runtime.add_schema(runtime.parse_schema(EXACT_SCHEMA))
        logits[dtype] = first_step(runtime, runtime.plan(prompt))[0]
    assert logits[torch.bfloat16].dtype == torch.float32
    # bf16 keeps ~3 significant digits; over 2 layers the logits stay within 0.1 absolute.
    assert (logits[torch.bfloat16] - logits[torch.float32]).abs().max().item() <= 0.1
    assert int(logits[torch.bfloat16].argmax()) == int(logits[torch.float32].argmax())
