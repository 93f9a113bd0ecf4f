"""Position layout of schemas: running sums, unions, params, nesting (docs/pml.md)."""

from __future__ import annotations


def test_sequential_offsets(pml):
    schema = pml.schema("""<schema name="s">Intro text.
      <module name="a">Alpha module body.</module>
      <module name="b">Beta body, a bit longer than alpha.</module>
      Closing words.</schema>""")
    intro, a, b = pml.n("Intro text."), pml.n("Alpha module body."), pml.n("Beta body, a bit longer than alpha.")
    closing = pml.n("Closing words.")
    assert (schema.modules["a"].start, schema.modules["a"].end) == (intro, intro + a)
    assert (schema.modules["b"].start, schema.modules["b"].end) == (intro + a, intro + a + b)
    assert schema.num_positions == intro + a + b + closing
    assert [s.start for s in schema.segments] == [0, intro, intro + a, intro + a + b]


def test_always_included_ranges_are_the_text_outside_modules(pml):
    schema = pml.schema("""<schema name="s">Intro text.
      <module name="a">Alpha module body.</module>
      <module name="b">Beta body, a bit longer than alpha.</module>
      Closing words.</schema>""")
    assert schema.always_included() == [(0, schema.modules["a"].start),
                                        (schema.modules["b"].end, schema.num_positions)]
    nested = pml.schema("""<schema name="s"><module name="m">Only a module.</module></schema>""")
    assert nested.always_included() == []


def test_union_spans_longest_member_and_members_share_start(pml):
    schema = pml.schema("""<schema name="s">Head.
      <union>
        <module name="short">Tiny.</module>
        <module name="long">A much longer member with many more words in it.</module>
      </union>
      <module name="after">After the union.</module></schema>""")
    head, short, long = pml.n("Head."), pml.n("Tiny."), pml.n("A much longer member with many more words in it.")
    assert schema.modules["short"].start == schema.modules["long"].start == head
    assert schema.modules["short"].end == head + short
    assert schema.modules["after"].start == head + max(short, long)


def test_param_reserves_its_length_and_both_spellings(pml):
    schema = pml.schema("""<schema name="s"><module name="m">Go for <param name="days" len="5"/> days
      and <parameter name="nights" length="3"/> nights.</module></schema>""")
    m = schema.modules["m"]
    go = pml.n("Go for ")
    assert m.params["days"].start == go and m.params["days"].length == 5
    and_ = pml.n(" days\nand ")
    assert m.params["nights"].start == go + 5 + and_
    assert m.end == go + 5 + and_ + 3 + pml.n(" nights.")


def test_nested_modules_sum_children(pml):
    schema = pml.schema("""<schema name="s"><module name="outer">Outer start.
      <module name="inner">Inner text.</module>
      <union><module name="x">X.</module><module name="y">Why so long.</module></union>
      Outer end.</module></schema>""")
    outer = schema.modules["outer"]
    expected = (pml.n("Outer start.") + pml.n("Inner text.") + max(pml.n("X."), pml.n("Why so long."))
                + pml.n("Outer end."))
    assert outer.num_positions == expected
    assert schema.modules["outer.inner"].start == pml.n("Outer start.")
    assert schema.modules["outer.x"].path == "outer.x"
    assert [m["path"] for m in schema.module_table()] == ["outer", "outer.inner", "outer.x", "outer.y"]


def test_segment_contexts_are_guaranteed_content_only(pml):
    schema = pml.schema("""<schema name="s">Root one.
      <module name="a">A one.<module name="b">B.</module>A two.</module>
      <module name="c">C.</module>Root two.</schema>""")
    by_text = {pml.encoder.encode(t): None for t in ()}
    del by_text
    segs = {(s.owner, s.start): s for s in schema.segments}
    root1, a1, b, a2, c, root2 = sorted(segs.values(), key=lambda s: s.start)
    assert (root1.owner, a1.owner, b.owner, a2.owner, c.owner, root2.owner) == ("", "a", "a.b", "a", "c", "")
    assert a1.context_ids == (root1.segment_id,)
    assert b.context_ids == (root1.segment_id, a1.segment_id)
    assert a2.context_ids == (root1.segment_id, a1.segment_id)  # not the optional b
    assert c.context_ids == (root1.segment_id,)
    assert root2.context_ids == (root1.segment_id,)


def test_role_sections_compile_with_chat_template(pml, tokenizer):
    schema = pml.schema("""<schema name="chat"><system>You are terse.</system>
      <user><module name="doc">The sky is blue.</module></user></schema>""")
    plan = pml.prompt('<prompt schema="chat"><user><doc/>What colour is the sky?</user><assistant/></prompt>')
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "The sky is blue.What colour is the sky?"}],
        tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(plan.token_ids()) == rendered
    assert plan.position_ids() == list(range(len(plan.token_ids())))
    assert schema.role_sections[0].role == "system"


def test_schema_without_chat_template_uses_plain_format(tokenizer):
    import copy

    from promptcache.pml import PLAIN_CHAT_FORMAT, TextEncoder, parse_schema
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    encoder = TextEncoder.from_tokenizer(bare)
    assert encoder.chat_format == PLAIN_CHAT_FORMAT
    schema = parse_schema('<schema name="s"><user>Hi</user></schema>', encoder)
    text = bare.decode([t for s in schema.segments for t in s.token_ids])
    assert text == "User: Hi\n\n"


def test_xml_escapes_reach_the_tokenizer_decoded(pml):
    schema = pml.schema('<schema name="s"><module name="m">if a &lt; b &amp;&amp; c &gt; d: &#65;</module></schema>')
    assert schema.segments[0].token_ids == pml.encoder.encode("if a < b && c > d: A")


def test_comments_are_ignored_everywhere(pml):
    schema = pml.schema("""<schema name="s"><!-- top -->Hello <!-- mid -->world.
      <union><!-- in union --><module name="a">A<!-- inside -->B</module><!-- x --></union></schema>""")
    assert schema.segments[0].token_ids == pml.encoder.encode("Hello world.")
    assert schema.segments[1].token_ids == pml.encoder.encode("AB")


def test_whitespace_rule_drops_layout_keeps_inline_spaces(pml):
    schema = pml.schema("""<schema name="s">
        <module name="m">
          Line one
            indented
          Line three
        </module>
        <module name="p" xml:space="preserve">  keep  </module></schema>""")
    assert schema.segments[0].token_ids == pml.encoder.encode("Line one\n  indented\nLine three")
    assert schema.segments[1].token_ids == pml.encoder.encode("  keep  ")


def test_cache_false_modules_are_computed_as_new_tokens(pml):
    pml.schema('<schema name="s">Root.<module name="live" cache="false">Fresh.</module></schema>')
    plan = pml.prompt('<prompt schema="s"><live/></prompt>')
    assert [r.kind for r in plan.new_runs] == ["module"]
    assert [c.segment.owner for c in plan.cached] == [""]


def test_param_encoding_placeholder_or_skip(pml):
    text = '<schema name="p{0}" {1}>Hi. <module name="m">Go for <param name="d" len="3"/> days.</module></schema>'
    placeholder = pml.schema(text.format(1, ""))
    slot = [s for s in placeholder.segments if s.is_placeholder]
    assert len(slot) == 1 and slot[0].token_ids == (pml.encoder.placeholder_id,) * 3
    after = placeholder.segments[slot[0].segment_id + 1]
    assert slot[0].segment_id in after.context_ids  # " days." was encoded after the placeholders
    plan = pml.prompt('<prompt schema="p1"><m d="2"/>Q</prompt>')
    assert not any(c.segment.is_placeholder for c in plan.cached) and not plan.is_exact
    skip = pml.schema(text.format(2, 'params="skip"'))
    assert not any(s.is_placeholder for s in skip.segments)
    assert pml.prompt('<prompt schema="p2"><m/>Q</prompt>').is_exact  # no argument, nothing skipped is missing
    import pytest

    from promptcache.pml import SchemaError
    with pytest.raises(SchemaError, match="placeholder"):
        pml.schema(text.format(3, 'params="other"'))
