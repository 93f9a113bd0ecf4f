"""The Prompt Cache dialect served from cache, against oracles: where a plan is exact, its tokens are the
chat template's rendering (add_generation_prompt=True) and the cached prefill equals a full prefill of
them at the layout's positions; where it is not, the cached prefill equals the masked forward of its approximation
(tests/model_runtime/oracles.py), which a union scaffold or a parameter scaffold changes."""

from __future__ import annotations

import pytest

from promptcache.model_runtime import SamplingParams
from promptcache.model_runtime.baseline import full_prefill_greedy, full_prefill_logits
from tests.model_runtime.engine_probe import engine_tokens, first_step
from tests.model_runtime.oracles import approximation_reference

ARCHS = ["llama", "gpt2"]
MBTI = """<schema name="mbti">
    <!-- as the reference's benchmark schemas: union scaffolds inside the user turn -->
    <system>You are a helpful assistant.</system>
    <user>
        Create a character.
        <union scaffold="EI">
            <module name="EI">Trait EI.</module>
            <module name="E">E (energized by people)</module>
            <module name="I">I (energized by solitude)</module>
        </union>
        <union scaffold="SN">
            <module name="SN">Trait SN.</module>
            <module name="S">S (practical)</module>
            <module name="N">N (imaginative)</module>
        </union>
        Ready?
    </user>
</schema>"""
LIVE = """<schema name="live">
    <system>Answer from the data.</system>
    <user>
        <module name="doc">The river flows north.</module>
        <module name="feed" cache="false">Today the water is high.</module>
    </user>
</schema>"""
PARAMS = """<schema name="trip">
    <module name="plan">Plan a trip of <parameter name="days" length="4" scaffold="a few"/> days, then rest.</module>
    <module name="tail">Answer briefly.</module>
</schema>"""


def _runtime(tiny_runtime, arch: str, schema: str):
    runtime = tiny_runtime(arch)
    runtime.add_schema(runtime.parse_schema(schema))
    return runtime


def _rendered(runtime, messages: list[dict[str, str]]) -> list[int]:
    tokenizer = runtime.loaded.tokenizer
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def _check_exact_against_rendering(runtime, prompt: str, messages: list[dict[str, str]]) -> None:
    plan = runtime.plan(prompt, add_generation_prompt=True)
    assert plan.is_exact, plan.approximations
    assert plan.generation_prompt_added
    rendered = _rendered(runtime, messages)
    assert plan.token_ids() == rendered
    # At the layout's positions (a union spans its longest member, so they may have gaps).
    model, positions = runtime.loaded.model, plan.position_ids()
    logits, _ = first_step(runtime, plan)
    reference = full_prefill_logits(model, rendered, positions)[-1]
    assert (logits - reference).abs().max().item() <= 1e-4
    tokens = engine_tokens(runtime, plan, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert tokens == full_prefill_greedy(model, rendered, positions, 8)


def _check_approximation(runtime, plan) -> None:
    logits, _ = first_step(runtime, plan)
    tokens, positions, mask = approximation_reference(plan)
    reference = full_prefill_logits(runtime.loaded.model, tokens, positions, attention_mask=mask)[-1]
    assert (logits - reference).abs().max().item() <= 1e-4
    plain = full_prefill_logits(runtime.loaded.model, plan.token_ids(), plan.position_ids())[-1]
    assert (logits - plain).abs().max().item() > 1e-4  # the approximation is real, and visible


@pytest.mark.parametrize("arch", ARCHS)
def test_importing_union_scaffolds_is_exact(tiny_runtime, arch):
    runtime = _runtime(tiny_runtime, arch, MBTI)
    _check_exact_against_rendering(
        runtime, '<prompt schema="mbti"><EI/><SN/><user>Who are you?</user></prompt>',
        [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Create a character.Trait EI.Trait SN.Ready?"},
         {"role": "user", "content": "Who are you?"}])


@pytest.mark.parametrize("arch", ARCHS)
def test_another_member_than_the_scaffold_is_the_approximation_it_reports(tiny_runtime, arch):
    runtime = _runtime(tiny_runtime, arch, MBTI)
    plan = runtime.plan('<prompt schema="mbti"><E/><N/></prompt>', add_generation_prompt=True)
    assert not plan.is_exact and plan.generation_prompt_added
    assert any("'EI'" in r and "'SN'" not in r for r in plan.approximations), plan.approximations
    assert any("'SN'" in r for r in plan.approximations)  # the text after both unions saw both scaffolds
    _check_approximation(runtime, plan)
    # The scaffold is the context: N's encoding is the one after EI, which plain guaranteed context lacks.
    n_segment = plan.schema.segments_of("N")[0]
    ei = {s.segment_id for s in plan.schema.segments_of("EI")}
    assert ei <= set(n_segment.context_ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_false_module_at_the_end_of_the_turn_is_exact(tiny_runtime, arch):
    runtime = _runtime(tiny_runtime, arch, LIVE)
    _check_exact_against_rendering(
        runtime, '<prompt schema="live"><user><doc/><feed/>Which way?</user></prompt>',
        [{"role": "system", "content": "Answer from the data."},
         {"role": "user", "content": "The river flows north.Today the water is high.Which way?"}])
    plan = runtime.plan('<prompt schema="live"><user><doc/><feed/>Which way?</user></prompt>',
                        add_generation_prompt=True)
    assert [r.source for r in plan.new_runs if r.kind == "module"] == ["feed"]


@pytest.mark.parametrize("arch", ARCHS)
def test_parameter_scaffold_is_what_the_text_after_the_slot_was_encoded_after(tiny_runtime, arch):
    runtime = _runtime(tiny_runtime, arch, PARAMS)
    plan = runtime.plan('<prompt schema="trip"><plan days="3"/><tail/></prompt>', add_generation_prompt=True)
    assert not plan.is_exact
    _check_approximation(runtime, plan)
    slot = next(s for s in plan.schema.segments_of("plan") if s.is_placeholder)
    assert slot.token_ids[:len(runtime.text_encoder.encode("a few"))] == runtime.text_encoder.encode("a few")
