"""SentencePiece (Llama-2/Mistral-style) tokenizers at PML piece boundaries: a prompt's token ids equal the
tokenizer's own tokenization of the text it renders to wherever pieces meet at a space, punctuation or
a line break (no "▁" inserted at each boundary by the dummy prefix); a word split across two pieces stays
two pieces (documented in docs/pml.md); exact fidelity equals a full prefill of the plan's ids."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("sentencepiece")

from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime, SamplingParams
from promptcache.model_runtime.baseline import full_prefill_greedy
from promptcache.model_runtime.engine import Engine, EngineConfig, Fidelity
from tests.sentencepiece_model import sentencepiece_loaded

SCHEMA = """<schema name="sp"><module name="a">The river flows north.</module><module name="b"> Cats sleep most of the day;</module><module name="c" xml:space="preserve">
Rome wasn't built in a day.</module><module name="d">Plan a trip of <param name="days" len="4"/> days to Paris: cafés.</module><module name="e">Tea is bre</module><module name="f">wed hot.</module></schema>"""

CASES = [  # (prompt, the text it renders to)
    ('<prompt schema="sp"><a/><b/> Where does the river flow?</prompt>',
     "The river flows north. Cats sleep most of the day; Where does the river flow?"),
    ('<prompt schema="sp"><a/><c/>Who sleeps?</prompt>',
     "The river flows north.\nRome wasn't built in a day.Who sleeps?"),
    ('<prompt schema="sp"><a/><d days=" 3"/> Where?</prompt>',
     "The river flows north.Plan a trip of  3 days to Paris: cafés. Where?"),
    ('<prompt schema="sp"><a/><b/>, and naïve cafés: é€!</prompt>',
     "The river flows north. Cats sleep most of the day;, and naïve cafés: é€!"),
]


@pytest.fixture(scope="module")
def runtime():
    loaded, _ = sentencepiece_loaded()
    runtime = ModelRuntime(loaded, build_store(StoreConfig()))
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    return runtime


def test_the_tokenizer_is_sentencepiece_with_a_dummy_prefix(runtime):
    tokenizer = sentencepiece_loaded()[1]
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("river", add_special_tokens=False))[0].startswith("▁")
    assert runtime.text_encoder.continuation_ids is not None  # detected: pieces are encoded as continuations
    assert runtime.text_encoder.bos_token_ids == (tokenizer.bos_token_id,)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_prompt_ids_equal_the_tokenization_of_the_rendered_text(runtime, case):
    prompt, rendered = CASES[case]
    tokenizer = sentencepiece_loaded()[1]
    plan = runtime.plan(prompt)
    assert tokenizer.decode(plan.token_ids(), skip_special_tokens=True) == rendered  # no space added or lost
    assert plan.token_ids() == tokenizer.encode(rendered, add_special_tokens=True)


def test_a_word_split_across_pieces_keeps_its_text_but_not_its_tokens(runtime):
    """'Tea is bre' + 'wed hot.': the text is exact, the ids are two pieces' (PML's documented limit)."""
    tokenizer = sentencepiece_loaded()[1]
    plan = runtime.plan('<prompt schema="sp"><e/><f/></prompt>')
    assert tokenizer.decode(plan.token_ids(), skip_special_tokens=True) == "Tea is brewed hot."
    whole = tokenizer.encode("Tea is brewed hot.", add_special_tokens=True)
    assert plan.token_ids() != whole and len(plan.token_ids()) >= len(whole)


def test_a_module_laid_out_after_others_is_encoded_as_a_continuation_even_when_first(runtime):
    """d is laid out after a, b, c and encoded once, as text following them (no dummy "▁"); a prompt that
    imports d alone starts with that encoding — the other documented limit of encoding modules once."""
    tokenizer = sentencepiece_loaded()[1]
    plan = runtime.plan('<prompt schema="sp"><d days=" 3"/></prompt>')
    assert tokenizer.convert_ids_to_tokens(plan.token_ids()[1:3]) == ["P", "lan"]
    assert tokenizer.decode(plan.token_ids(), skip_special_tokens=True) == "Plan a trip of  3 days to Paris: cafés."


def test_byte_level_bpe_needs_no_continuation_encoding():
    from tests.conftest import make_tiny_runtime

    assert make_tiny_runtime("llama").text_encoder.continuation_ids is None


def test_exact_fidelity_equals_full_prefill_of_the_prompt_ids(runtime):
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    async def tokens(plan):
        out = []
        async for event in engine.submit(plan, params, fidelity=Fidelity("exact")):
            assert event.error is None, event.error
            if event.token_id is not None:
                out.append(event.token_id)
        return out

    try:
        for prompt, _ in CASES:
            plan = runtime.plan(prompt)
            ids = plan.token_ids()
            assert asyncio.run(tokens(plan)) == full_prefill_greedy(runtime.loaded.model, ids, list(range(len(ids))), 6)
    finally:
        engine.stop()
