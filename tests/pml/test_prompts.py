"""Prompts against schemas: imports, arguments, text placement, plans and exactness."""

from __future__ import annotations

import pytest

from promptcache.pml import (
    ArgumentTooLongError,
    DuplicateImportError,
    EmptyPromptError,
    PositionConflictError,
    PromptError,
    UnknownModuleError,
    UnknownParamError,
    UnknownSchemaError,
)

DOCS = """<schema name="docs">Answer from the documents.
  <module name="d1">First document about cats.</module>
  <module name="d2">Second document about dogs and their owners.</module>
  <module name="d3">Third document, about birds.</module>
</schema>"""


def test_import_order_does_not_change_positions(pml):
    pml.schema(DOCS)
    forward = pml.prompt('<prompt schema="docs"><d1/><d3/></prompt>')
    backward = pml.prompt('<prompt schema="docs"><d3/><d1/></prompt>')
    assert forward.position_ids() == backward.position_ids()
    assert forward.token_ids() == backward.token_ids()
    assert forward.module_paths == backward.module_paths == ("d1", "d3")


def test_text_between_imports_goes_after_preceding_import(pml):
    pml.schema("""<schema name="s"><module name="a">Alpha.<param name="gap" len="8"/></module>
      <module name="b">Beta.</module></schema>""")
    plan = pml.prompt('<prompt schema="s"><a/>Note<b/></prompt>')
    run = plan.new_runs[0]
    assert run.start == pml.n("Alpha.") and run.token_ids == pml.encoder.encode("Note")


def test_text_between_imports_that_does_not_fit_is_rejected(pml):
    pml.schema(DOCS)
    with pytest.raises(PositionConflictError, match=r"only 0 positions are free.*<param> buffer"):
        pml.prompt('<prompt schema="docs"><d1/>Some words in between<d2/></prompt>')


def test_trailing_text_goes_after_highest_used_position(pml):
    schema = pml.schema(DOCS)
    plan = pml.prompt('<prompt schema="docs"><d1/>Question?</prompt>')
    assert plan.new_runs[0].start == schema.modules["d1"].end  # nothing used after d1
    assert plan.new_runs[0].token_ids == pml.encoder.encode("Question?")


def test_text_only_and_empty_prompts(pml):
    schema = pml.schema(DOCS)
    plan = pml.prompt('<prompt schema="docs">Just text</prompt>')
    assert plan.module_paths == () and plan.new_runs[0].start == pml.n("Answer from the documents.")
    assert schema.num_positions > plan.new_runs[0].start  # optional modules' positions stay unused
    empty = pml.prompt('<prompt schema="docs"/>')
    assert empty.num_new_tokens == 0 and empty.num_cached_tokens == pml.n("Answer from the documents.")
    pml.schema('<schema name="nothing"><module name="m">x</module></schema>')
    with pytest.raises(EmptyPromptError):
        pml.prompt('<prompt schema="nothing"/>')


def test_union_member_choice_and_conflicts(pml):
    pml.schema("""<schema name="u"><union default="en"><module name="en">Hello.</module>
      <module name="fr">Bonjour tout le monde.</module></union></schema>""")
    assert pml.prompt('<prompt schema="u"><fr/></prompt>').module_paths == ("fr",)
    assert pml.prompt('<prompt schema="u">Hi</prompt>').module_paths == ("en",)  # default member
    with pytest.raises(DuplicateImportError, match=r"members of one <union>"):
        pml.prompt('<prompt schema="u"><en/><fr/></prompt>')


def test_nested_union_path_and_skipped_level(pml):
    pml.schema("""<schema name="t"><module name="trip">Trip to
      <union><module name="miami">Miami.</module><module name="paris">Paris.</module></union></module></schema>""")
    plan = pml.prompt('<prompt schema="t"><trip><paris/></trip></prompt>')
    assert plan.module_paths == ("trip", "trip.paris")
    with pytest.raises(UnknownModuleError, match=r"<paris>.*nested as 'trip.paris'"):
        pml.prompt('<prompt schema="t"><paris/></prompt>')


def test_unknown_names_are_named(pml):
    pml.schema(DOCS)
    with pytest.raises(UnknownModuleError, match="<d9>"):
        pml.prompt('<prompt schema="docs"><d9/></prompt>')
    with pytest.raises(UnknownParamError, match="'color'"):
        pml.prompt('<prompt schema="docs"><d1 color="red"/></prompt>')
    with pytest.raises(UnknownSchemaError, match="'nope'"):
        pml.prompt('<prompt schema="nope"/>')


def test_module_imported_twice(pml):
    pml.schema(DOCS)
    with pytest.raises(DuplicateImportError, match="'d1' is imported twice"):
        pml.prompt('<prompt schema="docs"><d1/><d2/><d1/></prompt>')


def test_arguments_short_long_and_missing(pml):
    pml.schema('<schema name="p"><module name="trip">Go for <param name="days" len="4"/> days.</module></schema>')
    plan = pml.prompt('<prompt schema="p"><trip days="3"/></prompt>')
    arg = next(r for r in plan.new_runs if r.kind == "argument")
    assert arg.token_ids == pml.encoder.encode("3") and arg.start == pml.n("Go for ")
    assert plan.num_prompt_tokens == pml.n("Go for ") + pml.n("3") + pml.n(" days.")  # rest of the slot unused
    with pytest.raises(ArgumentTooLongError, match="the limit is 4 tokens"):
        pml.prompt('<prompt schema="p"><trip days="three whole long days and more"/></prompt>')
    missing = pml.prompt('<prompt schema="p"><trip/></prompt>')  # policy: a missing argument is empty
    assert [r.kind for r in missing.new_runs] == []


def test_text_inside_a_module_import_is_rejected(pml):
    pml.schema(DOCS)
    with pytest.raises(PromptError, match="inside the import <d1>"):
        pml.prompt('<prompt schema="docs"><d1>extra</d1></prompt>')


def test_question_inside_the_schema_user_turn(pml, tokenizer):
    schema = pml.schema("""<schema name="qa"><system>Be brief.</system>
      <user><module name="d1">Doc one.</module><module name="d2">Doc two.</module></user></schema>""")
    plan = pml.prompt('<prompt schema="qa"><user><d2/>Which doc?</user><assistant/></prompt>')
    assert tokenizer.decode(plan.token_ids()).endswith("Doc two.Which doc?<|im_end|>\n<|im_start|>assistant\n")
    question = plan.new_runs[0]
    assert question.start == schema.modules["d2"].end
    assert not any(c.segment.role_suffix_of is not None and c.segment.start > question.start for c in plan.cached)


def test_role_tag_around_modules_outside_any_section_is_rejected(pml):
    pml.schema(DOCS)
    with pytest.raises(PromptError, match="not inside a schema <user> section"):
        pml.prompt('<prompt schema="docs"><user><d1/>Q</user></prompt>')


def test_new_turns_in_the_prompt(pml, tokenizer):
    pml.schema(DOCS)
    plan = pml.prompt('<prompt schema="docs"><d1/><user>Q?</user><assistant>A.</assistant><user>Q2?</user>'
                      '<assistant/></prompt>')
    text = tokenizer.decode(plan.token_ids())
    assert text.endswith("<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\nA.<|im_end|>\n"
                         "<|im_start|>user\nQ2?<|im_end|>\n<|im_start|>assistant\n")


def test_exact_when_no_optional_parts(pml):
    pml.schema('<schema name="fixed"><system>Sys.</system><module name="m">Body.</module></schema>')
    plan = pml.prompt('<prompt schema="fixed"><m/>Question</prompt>')
    assert plan.is_exact and plan.approximations == ()


def test_approximate_when_an_optional_module_is_skipped_or_text_precedes(pml):
    pml.schema(DOCS)
    skipped = pml.prompt('<prompt schema="docs"><d1/><d3/>Q</prompt>')
    assert not skipped.is_exact and any("d3" in r for r in skipped.approximations)
    pml.schema('<schema name="g"><module name="a">A.<param name="buf" len="6"/></module>'
               '<module name="b">B.</module></schema>')
    gap = pml.prompt('<prompt schema="g"><a/>x<b/></prompt>')
    assert not gap.is_exact and any("precedes cached tokens" in r for r in gap.approximations)


def test_scaffold_gives_joint_contexts_when_fully_imported(pml):
    schema = pml.schema(DOCS.replace("</schema>", '<scaffold modules="d1 d2"/></schema>'))
    both = pml.prompt('<prompt schema="docs"><d1/><d2/>Q</prompt>')
    d2 = next(c for c in both.cached if c.segment.owner == "d2")
    d1 = next(c for c in both.cached if c.segment.owner == "d1")
    assert d2.variant == "scaffold:d1+d2" and d1.segment.segment_id in d2.context_ids
    assert both.is_exact
    one = pml.prompt('<prompt schema="docs"><d2/>Q</prompt>')
    assert next(c for c in one.cached if c.segment.owner == "d2").variant == "default"
    assert schema.scaffolds[0].module_paths == ("d1", "d2")


def test_isolated_mode_encodes_modules_alone(pml):
    pml.schema(DOCS)
    plan = pml.prompt('<prompt schema="docs"><d1/><d2/>Q</prompt>', isolated=True)
    assert all(c.variant == "isolated" for c in plan.cached)
    assert next(c for c in plan.cached if c.segment.owner == "d2").context_ids == ()


def test_question_in_turn_after_out_of_order_imports(pml):
    schema = pml.schema("""<schema name="qa2"><user><module name="d1">Doc one.</module>
      <module name="d2">Doc two.</module><module name="d3">Doc three.</module></user></schema>""")
    plan = pml.prompt('<prompt schema="qa2"><user><d2/><d1/>Which?</user><assistant/></prompt>')
    question = next(r for r in plan.new_runs if r.kind == "text")
    assert question.start == schema.modules["d2"].end  # after the section's highest used position
