"""PML parsing is linear in its input: 2 MiB adversarial documents get their schema, plan or 4xx error
within a second, and a 2 MiB valid schema parses within a second.

Each adversarial input below was slow before, measured on the 2-core test machine with the code it
replaced (quadratic growth: ×4 per doubling, so hours at 2 MiB). Timings use `WORDS`, an encoder with
one token per word, where the text itself would take a BPE tokenizer seconds: what they time is PML's
own work (XML, the whitespace rule, layout, contexts, placement); tokenizing is linear and timed
against PML in `test_parsing_costs_about_what_tokenizing_its_text_does`. Each timing is the best of two
runs, with the suite's heap frozen: the bound is on the algorithm, not on a neighbour's CPU burst or a
full garbage collection over the torch and transformers objects this process also holds.
"""

from __future__ import annotations

import gc
import time
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from promptcache.pml import (
    PmlError,
    PmlLimitError,
    PmlLimits,
    PromptPlan,
    TextEncoder,
    parse_prompt,
    parse_schema,
    xml_reader,
)
from promptcache.pml.xml_reader import normalize_whitespace

SIZE = 2 << 20  # bytes of each adversarial document
LIMITS = PmlLimits(max_schema_bytes=4 << 20, max_prompt_bytes=4 << 20)
WORDS = TextEncoder(encode_fn=lambda text: [len(word) for word in text.split()])
PROSE = "The quick brown fox jumps over the lazy dog. Plan a trip of three days to Miami or Paris.\n"


@pytest.fixture(autouse=True, scope="module")
def _frozen_heap():
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def _timed(call, *args, **kwargs):
    """(the result or the PmlError raised, the best of two runs' seconds)."""
    seconds = []
    for _ in range(2):
        started = time.perf_counter()
        try:
            result = call(*args, **kwargs)
        except PmlError as exc:
            result = exc
        seconds.append(time.perf_counter() - started)
    return result, min(seconds)


def _repeat(unit: str, size: int = SIZE) -> str:
    return unit * (size // len(unit))


@pytest.mark.parametrize(("raw", "expected"), [
    ("\n" + " " * SIZE + "x", "x"),  # layout whitespace before text: dropped
    (" " * SIZE + "x", " " * SIZE + "x"),  # spaces on one line are content
    ("x" + " \t" * (SIZE // 2) + "\ny", "x" + " \t" * (SIZE // 2) + "\ny"),
], ids=["layout", "content", "inner"])
def test_whitespace_rule_is_linear(raw, expected):
    """The old rule found the trailing run with `re.search(r"\\s*$")`, which retries from every position of
    a whitespace run not at the end: 1.6 s at 16 KiB, 4.7 s at 32 KiB, 21.6 s at 64 KiB."""
    result, seconds = _timed(normalize_whitespace, raw)
    assert result == expected and seconds < 1


def test_schema_and_prompt_text_with_long_whitespace_runs(encoder):
    """Every text node went through that rule: the real tokenizer sees only `Body` and `Question?` here."""
    run = " " * SIZE
    schema, seconds = _timed(parse_schema, f'<schema name="ws"><module name="m">\n{run}Body</module></schema>',
                             encoder, LIMITS)
    assert seconds < 1 and schema.modules["m"].num_positions == len(encoder.encode("Body"))
    plan, seconds = _timed(parse_prompt, f'<prompt schema="ws"><m/>\n{run}Question?</prompt>', {"ws": schema},
                           encoder, LIMITS)
    assert seconds < 1 and plan.new_token_ids() == list(encoder.encode("Question?"))


def test_many_text_pieces_exceed_the_context_budget_fast(encoder):
    """Every text piece's context lists the always-included text before it, and each turn's closing
    markup is a piece of its own: 8,000 turns would list 128 million segment ids. Contexts were built by
    rescanning every earlier segment: 2,000 turns (1.9 MB) took 4.5 s and 744 MB; now each context is a
    prefix of a per-owner list and the total is budgeted. (The real tokenizer: its ChatML markup makes
    the pieces; the texts are few, each tokenized once.)"""
    turn = f"<user>One question: {'why ' * 50}</user><assistant>And one answer.</assistant>"
    limits = PmlLimits(max_schema_bytes=4 << 20, max_schema_tokens=4_000_000)
    error, seconds = _timed(parse_schema, f'<schema name="turns">{_repeat(turn)}</schema>', encoder, limits)
    assert isinstance(error, PmlLimitError) and "contexts list more than" in str(error), error
    assert seconds < 1


def test_many_elements_and_scaffolds():
    """Each scaffold compared its name with every earlier one and scanned every segment for its
    contexts: 2,000 scaffolds took 0.05 s, 4,000 took 0.2 s, 55,000 (2 MiB) would take half a minute.
    Every element costs Python work, so a document's elements are counted (in C) before any is walked;
    scaffolds, each encoded on upload, have a limit of their own."""
    head = '<schema name="s">Head<module name="a">A</module>mid<module name="b">B</module>'
    units = [f'<scaffold modules="a b" name="s{i}"/>' for i in range((SIZE - len(head)) // 38)]
    error, seconds = _timed(parse_schema, head + "".join(units) + "</schema>", WORDS, LIMITS)
    assert isinstance(error, PmlLimitError) and "elements" in str(error) and seconds < 1
    error, seconds = _timed(parse_schema, head + "".join(units[:LIMITS.max_scaffolds + 1]) + "</schema>", WORDS,
                            LIMITS)
    assert isinstance(error, PmlLimitError) and "scaffolds" in str(error) and seconds < 1
    schema, seconds = _timed(parse_schema, head + "".join(units[:LIMITS.max_scaffolds]) + "</schema>", WORDS,
                             LIMITS)
    assert len(schema.scaffolds) == LIMITS.max_scaffolds and seconds < 1


def _importable_schema(num_unions: int, num_modules: int = 0) -> str:
    unions = "".join(f'<union><module name="u{i}">Text {i} <param name="a" len="4"/></module>'
                     f'<module name="o{i}">Other</module></union>' for i in range(num_unions))
    modules = "".join(f'<module name="m{i}">More {i} <param name="a" len="4"/></module>' for i in range(num_modules))
    return f'<schema name="s">{unions}{modules}</schema>'


@pytest.mark.parametrize("isolated", [False, True])
def test_prompt_importing_thousands_of_modules(isolated):
    """Placement looked up each import's positions, each import's union, each segment's scaffolds and
    each segment's predecessors by scanning the schema: a 60 KB prompt importing 4,000 modules took
    4.6 s, one choosing 4,000 union members 6.5 s. Here 2,700 imports with arguments, then 2 MiB of turns."""
    schema = parse_schema(_importable_schema(1300, 1400), WORDS, LIMITS)
    imports = "".join(f'<u{i} a="x y"/>' for i in range(1300)) + "".join(f'<m{i} a="z"/>' for i in range(1400))
    doc = f'<prompt schema="s">{imports}{_repeat(f"<user>{PROSE * 2}</user>", SIZE - len(imports))}</prompt>'
    plan, seconds = _timed(parse_prompt, doc, {"s": schema}, WORDS, LIMITS, isolated=isolated)
    assert seconds < 1
    assert len(plan.cached) == 2700 and len(plan.module_paths) == 2700


@pytest.mark.parametrize("doc", [
    '<prompt schema="s" ' + "".join(f'a{i}="1" ' for i in range(SIZE // 10)) + "/>",  # refused: unknown
    '<prompt schema="s" ' + "".join(f'xmlns:a{i}="u" ' for i in range(SIZE // 16)) + "/>",
    '<prompt schema="s">' + _repeat("<nope/>", SIZE) + "</prompt>",  # more elements than the limit
    '<prompt schema="s">' + _repeat("<!-- c -->", SIZE) + "</prompt>",
    '<prompt schema="s">' + _repeat("&#60;", SIZE) + "</prompt>",
], ids=["attributes", "namespaces", "elements", "comments", "character-references"])
def test_xml_shapes_answer_fast(doc):
    """lxml (libxml2) is linear in each of these; what walks the tree stops at the first error or visits
    each node once."""
    schema = parse_schema(_importable_schema(2), WORDS, LIMITS)
    result, seconds = _timed(parse_prompt, doc, {"s": schema}, WORDS, LIMITS)
    assert seconds < 1
    assert isinstance(result, (PmlError, PromptPlan))


def _valid_schema(size: int, num_scaffolds: int = 4) -> tuple[str, int]:
    """A chat-shaped schema of documents: per turn a module of prose with a param, a union, a module
    that is never cached, and text around them; scaffolds over the first modules."""
    turns, total = [], 0
    while total < size:
        i = len(turns)
        turn = (f'<user>Question {i}: <module name="doc{i}">\n    {PROSE * 200}    <param name="note" len="16"/>\n'
                f'    <union default="short{i}"><module name="short{i}">{PROSE}</module>'
                f'<module name="long{i}">{PROSE * 3}</module></union>\n'
                f'    <module name="sub{i}" cache="false">{PROSE}</module>\n  </module></user>'
                f"<assistant>Noted {i}.</assistant>\n")
        turns.append(turn)
        total += len(turn)
    scaffolds = "".join(f'<scaffold modules="doc{j} doc{j + 1}"/>' for j in range(0, 2 * num_scaffolds, 2))
    doc = f'<schema name="big"><system>You answer from the documents.</system>\n{"".join(turns)}{scaffolds}</schema>'
    return doc, len(turns)


def test_valid_2mib_schema_parses_in_under_a_second():
    doc, num_turns = _valid_schema(SIZE)
    schema, seconds = _timed(parse_schema, doc, WORDS, LIMITS)
    assert seconds < 1, seconds
    assert len(schema.modules) == 4 * num_turns + 1 and len(schema.scaffolds) == 4


def test_parsing_costs_about_what_tokenizing_its_text_does(encoder):
    """With the real BPE tokenizer a 2 MiB schema takes seconds on this machine, nearly all of it the
    tokenizer's (about 1 MB/s here): parsing stays within a small factor of tokenizing the document once.
    (Each text was tokenized twice before, the second time to compare with its sequence-start encoding,
    which a tokenizer without a continuation sentinel never needs.)"""
    doc, _ = _valid_schema(SIZE)
    _, tokenize_s = _timed(encoder.encode_fn, doc)  # the tokenizer itself: the document is one piece over the cap
    schema, parse_s = _timed(parse_schema, doc, encoder, LIMITS)
    assert not isinstance(schema, PmlError)
    assert parse_s < 1.5 * tokenize_s + 0.5, (parse_s, tokenize_s)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["<", "&", "a", ";", "#", "x", "1", " ", "/", "amp;", "&lt;", "<b>", "&#12;", "&#x1F;",
                                 "\u00e9", "<![CDATA[", "]]>"]), max_size=400),
       st.integers(min_value=1, max_value=16))
def test_bare_markup_escaped_in_slices_as_in_one_pass(pieces, slice_bytes):
    """Escaping runs a slice at a time (so no one call holds the GIL for long); the slices end where no pattern's
    lookahead reaches across, so the result is that of one pass over the text."""
    data = "".join(pieces).encode()

    def one_pass(text: bytes) -> bytes:
        return xml_reader._BARE_LESS_THAN.sub(b"&lt;", xml_reader._BARE_AMPERSAND.sub(b"&amp;", text))

    with patch.object(xml_reader, "_ESCAPE_SLICE_BYTES", slice_bytes):
        assert xml_reader._escape_text(data) == one_pass(data)
