"""SentencePiece (Llama-2/Mistral) tokenizers at PML piece boundaries, on checkpoints loaded by
`load_model` (tests/sentencepiece_model.py: one trained `tokenizer.model`, three ways of shipping it).

Each case lists the text pieces of a prompt in position order (module text, arguments, new text);
the rendered text is their concatenation. Oracles: the tokenizer's own tokenization of the rendered
text, and SentencePiece itself (with its dummy prefix off, for a piece that continues other text).
- "whole": the plan's ids are the tokenization of the rendered text;
- "start": a schema piece laid out after others begins the prompt: its ids were fixed as a
  continuation, so the plan either equals the tokenization anyway or says so in `approximations`,
  and differs in that piece only;
- "split": a word or a whitespace run split across two pieces keeps the two pieces' tokens (the same
  with byte-level BPE): the text is exact, the ids are not, nothing is reported (docs/pml.md).
Answers in `exact` fidelity equal a full prefill of the plan's ids.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("sentencepiece")

from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime, SamplingParams
from promptcache.model_runtime.baseline import full_prefill_greedy
from promptcache.model_runtime.engine import Engine, EngineConfig, Fidelity
from promptcache.pml import ArgumentTooLongError, TextEncoder, parse_prompt, parse_schema
from tests.model_factories import make_test_tokenizer
from tests.model_runtime.engine_probe import engine_tokens
from tests.sentencepiece_model import TOKENIZER_KINDS, sentencepiece_loaded, sentencepiece_processor

SCHEMA = """<schema name="sp">
  <module name="intro">The river flows north.</module>
  <module name="cats"> Cats sleep most of the day;</module>
  <module name="rome" xml:space="preserve">
Rome wasn't built in a day.</module>
  <module name="trip">Plan a trip of <param name="days" len="4"/> days to Paris: cafés.</module>
  <union>
    <module name="naive">Naïve façade €</module>
    <module name="indented" xml:space="preserve">    An indented line.</module>
  </union>
  <module name="deja">, déjà vu!</module>
  <module name="cjk">日本 (bytes)</module>
  <module name="tea">Tea is bre</module>
  <module name="wed">wed hot.</module>
  <module name="greet"><param name="who" len="6"/>, welcome.</module>
  <module name="count"><param name="n" len="1"/> apples.</module>
</schema>"""
INTRO = "The river flows north."
TRIP = ["Plan a trip of ", "3", " days to Paris: cafés."]

CASES = [  # (prompt body, pieces in position order, kind of case)
    ("<intro/><cats/> Where does the river flow?",
     [INTRO, " Cats sleep most of the day;", " Where does the river flow?"], "whole"),
    ("<intro/><rome/>Who sleeps?", [INTRO, "\nRome wasn't built in a day.", "Who sleeps?"], "whole"),
    ('<intro/><trip days="3"/> Where?', [INTRO, *TRIP, " Where?"], "whole"),
    ("<intro/><naive/><deja/>", [INTRO, "Naïve façade €", ", déjà vu!"], "whole"),  # € by byte fallback
    ("<intro/><indented/><deja/>", [INTRO, "    An indented line.", ", déjà vu!"], "whole"),
    ("<intro/><cats/><cjk/>", [INTRO, " Cats sleep most of the day;", "日本 (bytes)"], "whole"),
    ("<intro/> naïve € 日本?", [INTRO, " naïve € 日本?"], "whole"),
    ('<intro/><greet who=" Cats"/>', [INTRO, " Cats", ", welcome."], "whole"),  # a value's leading space
    ("Where does the river flow?", ["Where does the river flow?"], "whole"),  # new text starts the sequence
    ('<greet who="Cats"/>', ["Cats", ", welcome."], "whole"),  # an argument starts the sequence
    ('<greet who=" Cats"/> Who?', [" Cats", ", welcome.", " Who?"], "whole"),
    ('<trip days="3"/>', TRIP, "start"),
    ("<naive/><deja/>", ["Naïve façade €", ", déjà vu!"], "start"),
    ("<cats/>", [" Cats sleep most of the day;"], "start"),
    ("<indented/>", ["    An indented line."], "start"),
    ("<deja/>", [", déjà vu!"], "start"),
    ("<greet/> Who?", [", welcome.", " Who?"], "start"),  # no argument: the module text after the slot
    ("<intro/><tea/><wed/>", [INTRO, "Tea is bre", "wed hot."], "split"),
    ('<intro/><trip days=" 3"/>', [INTRO, "Plan a trip of ", " 3", " days to Paris: cafés."], "split"),
]
PRESERVED = ('<prompt schema="sp" xml:space="preserve"><intro/>\n€ and 日本\n</prompt>', [INTRO, "\n€ and 日本\n"])
START_NOTE = "starts this prompt"


@pytest.fixture(scope="module", params=TOKENIZER_KINDS)
def runtime(request):
    runtime = ModelRuntime(sentencepiece_loaded(request.param), build_store(StoreConfig()))
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    return runtime


def _piecewise(tokenizer, pieces: list[str], *, first_at_start: bool) -> list[int]:
    """PML's documented tokenization, from SentencePiece itself: BOS, the first piece as a sequence
    start (or as a continuation), every later piece as it tokenizes after other text."""
    continuation = sentencepiece_processor(dummy_prefix=False)
    head = pieces[0]
    first = tokenizer.encode(head, add_special_tokens=False) if first_at_start else continuation.encode(head)
    return [tokenizer.bos_token_id, *first, *(t for piece in pieces[1:] for t in continuation.encode(piece))]


def test_the_checkpoint_is_a_sentencepiece_llama(runtime):
    tokenizer = runtime.loaded.tokenizer
    assert runtime.loaded.architecture == "llama" and tokenizer.is_fast
    sentencepiece = sentencepiece_processor()
    for text in (INTRO, "Naïve façade € 日本", "a  b\n c 12345"):  # none starts with a space
        assert tokenizer.encode(text) == sentencepiece.encode(text, add_bos=True)
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("€", add_special_tokens=False)) == \
        ["▁", "<0xE2>", "<0x82>", "<0xAC>"]
    encoder = runtime.text_encoder
    assert encoder.continuation_ids is not None  # the dummy prefix was detected
    assert encoder.bos_token_ids == (tokenizer.bos_token_id,)
    assert encoder.placeholder_id == tokenizer.unk_token_id


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[2]}:{c[0]}")
def test_prompt_ids_against_the_tokenization_of_the_rendered_text(runtime, case):
    body, pieces, kind = case
    tokenizer = runtime.loaded.tokenizer
    plan = runtime.plan(f'<prompt schema="sp">{body}</prompt>')
    ids, rendered = plan.token_ids(), "".join(pieces)
    whole = tokenizer.encode(rendered)
    notes = [a for a in plan.approximations if START_NOTE in a]
    assert ids == _piecewise(tokenizer, pieces, first_at_start=kind != "start")
    if kind == "whole":
        assert ids == whole and not notes
    elif kind == "split":  # the text is exact, its tokens are two pieces'
        assert ids != whole and not notes
        assert tokenizer.decode(ids, skip_special_tokens=True) == rendered
    else:
        at_start = tokenizer.encode(pieces[0], add_special_tokens=False)
        as_continuation = sentencepiece_processor(dummy_prefix=False).encode(pieces[0])
        if at_start == as_continuation:
            assert ids == whole and not notes
        else:  # reported, and the reported piece is the only difference
            module = body[1:].split("/")[0].split()[0]
            assert len(notes) == 1 and f"module {module!r}" in notes[0] and not plan.is_exact
            assert whole == [tokenizer.bos_token_id, *at_start, *ids[1 + len(as_continuation):]]


def test_the_legacy_normalizer_tokenizes_like_sentencepiece_itself():
    """tokenizer.json as Llama-2 ships it: the whole cases equal SentencePiece's own ids."""
    tokenizer = sentencepiece_loaded("tokenizer-json").tokenizer
    sentencepiece = sentencepiece_processor()
    for _, pieces, kind in CASES:
        if kind == "whole":
            assert tokenizer.encode("".join(pieces)) == sentencepiece.encode("".join(pieces), add_bos=True)


def test_preserved_newlines_and_byte_fallback_after_a_module(runtime):
    prompt, pieces = PRESERVED
    assert runtime.plan(prompt).token_ids() == runtime.loaded.tokenizer.encode("".join(pieces))


def test_an_argument_that_starts_the_prompt_is_measured_as_a_sequence_start(runtime):
    """"3" is one token after other text and two ("▁", "3") at the start: `len="1"` fits only the first."""
    tokenizer = runtime.loaded.tokenizer
    plan = runtime.plan('<prompt schema="sp"><intro/><count n="3"/></prompt>')
    assert plan.token_ids() == tokenizer.encode(INTRO + "3 apples.")
    with pytest.raises(ArgumentTooLongError, match="starts the prompt, where it is 2 tokens"):
        runtime.plan('<prompt schema="sp"><count n="3"/></prompt>')


def test_a_segment_is_flagged_where_its_text_tokenizes_differently_at_the_sequence_start(runtime):
    tokenizer = runtime.loaded.tokenizer
    continuation = sentencepiece_processor(dummy_prefix=False)
    texts = [INTRO, " Cats sleep most of the day;", "\nRome wasn't built in a day.", "Plan a trip of ",
             " days to Paris: cafés.", "Naïve façade €", "    An indented line.", ", déjà vu!", "日本 (bytes)",
             "Tea is bre", "wed hot.", ", welcome.", " apples."]  # the schema's text, in layout order
    expected = [False] + [tokenizer.encode(t, add_special_tokens=False) != continuation.encode(t) for t in texts[1:]]
    segments = [s for s in runtime.get_schema("sp").segments if s.owner and not s.is_placeholder]
    assert [s.is_continuation for s in segments] == expected
    assert sum(expected) >= 8  # most first words lose their "▁" as a continuation


_LEGACY_LIMIT = pytest.mark.xfail(strict=True, reason="a legacy setup writes '▁' after a special token; the "
                                   "piece after one is encoded as a continuation (docs/pml.md)")


@pytest.mark.parametrize("kind", [pytest.param(k, marks=() if k == "llama" else _LEGACY_LIMIT)
                                  for k in TOKENIZER_KINDS])
def test_text_after_a_special_token_that_ends_a_piece(kind):
    """`llama` (non-legacy) adds no "▁" after a special token, as after any text: the pieces join
    exactly. The legacy setups write "▁" there; PML encodes the next piece as a continuation of the
    piece before it and does not report the difference (a known limit, docs/pml.md)."""
    loaded = sentencepiece_loaded(kind)
    encoder = TextEncoder.from_tokenizer(loaded.tokenizer)
    schema = parse_schema('<schema name="s"><module name="a">Cats sleep.&lt;/s&gt;</module>'
                          '<module name="b">Tea is hot.</module></schema>', encoder)
    plan = parse_prompt('<prompt schema="s"><a/><b/></prompt>', {"s": schema}, encoder)
    assert plan.token_ids() == loaded.tokenizer.encode("Cats sleep.</s>Tea is hot.")


def test_byte_level_bpe_is_unchanged():
    """No dummy prefix: no continuation encoding, no flagged segment, no note; a split word splits
    the same way."""
    tokenizer = make_test_tokenizer()
    encoder = TextEncoder.from_tokenizer(tokenizer)
    assert encoder.continuation_ids is None
    schema = parse_schema('<schema name="b"><module name="x">The river flows north.</module>'
                          '<module name="tea">Tea is bre</module><module name="wed">wed hot.</module></schema>',
                          encoder)
    assert not any(s.is_continuation for s in schema.segments)
    plan = parse_prompt('<prompt schema="b"><tea/><wed/></prompt>', {"b": schema}, encoder)
    assert not any(START_NOTE in a for a in plan.approximations)
    assert plan.token_ids() == tokenizer.encode("Tea is bre") + tokenizer.encode("wed hot.")
    assert plan.token_ids() != tokenizer.encode("Tea is brewed hot.")


EXACT_PROMPTS = [  # whole, start (reported) and split cases
    "<intro/> Where does the river flow?", "<intro/><cats/> Where does the river flow?",
    '<intro/><trip days="3"/> Where?', "<intro/><naive/><deja/>", "Where does the river flow?",
    '<greet who="Cats"/>', '<trip days="3"/>', "<intro/><tea/><wed/>"]


def test_exact_fidelity_equals_full_prefill_of_the_prompt_ids(runtime):
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    async def tokens(plan):
        out = []
        async for event in engine.submit(plan, params, fidelity=Fidelity("exact")):
            assert event.report is None or event.report.error is None, event.report
            if event.token_id is not None:
                out.append(event.token_id)
        return out

    model = runtime.loaded.model
    try:
        for body in EXACT_PROMPTS:
            plan = runtime.plan(f'<prompt schema="sp">{body}</prompt>')
            ids = plan.token_ids()
            assert asyncio.run(tokens(plan)) == full_prefill_greedy(model, ids, list(range(len(ids))), 6), body
    finally:
        engine.stop()


def test_a_prompt_without_optional_parts_served_from_cache_equals_full_prefill(runtime):
    """The module at the layout start, then new text: exact by construction, and its ids are the
    rendered text's, so the cached answer is the full prefill of that text."""
    plan = runtime.plan('<prompt schema="sp"><intro/> Where does the river flow?</prompt>')
    assert plan.is_exact, plan.approximations
    ids = runtime.loaded.tokenizer.encode(INTRO + " Where does the river flow?")
    assert plan.token_ids() == ids
    tokens = engine_tokens(runtime, plan, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert tokens == full_prefill_greedy(runtime.loaded.model, ids, plan.position_ids(), 8)
