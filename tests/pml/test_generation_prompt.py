"""`add_generation_prompt=True` (what the server asks): a prompt whose last turn is closed, or that ends in
text with no role, gets the model's assistant turn opened exactly as the chat template's
`add_generation_prompt` renders it; an open `<assistant>` turn is continued. Oracle: the tokenizer's
own `apply_chat_template(..., add_generation_prompt=True)`."""

from __future__ import annotations

import copy

import pytest

from promptcache.pml import TextEncoder, parse_prompt, parse_schema
from tests.model_factories import make_test_tokenizer

# A second template shape (Zephyr-like labels, no newline after the turn): the pieces come from the
# template, not from ChatML knowledge.
LABELLED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}")
SCHEMA = """<schema name="kb">
    <system>You are a helpful assistant.</system>
    <user>
        Read the documents.
        <module name="cats">Cats sleep most of the day.</module>
        <module name="tea">Tea is brewed with hot water.</module>
    </user>
</schema>"""
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def _tokenizer(template: str | None):
    tokenizer = copy.deepcopy(make_test_tokenizer())
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(params=["chatml", "labelled"])
def chat(request):
    tokenizer = make_test_tokenizer() if request.param == "chatml" else _tokenizer(LABELLED)
    encoder = TextEncoder.from_tokenizer(tokenizer)
    schemas = {"kb": parse_schema(SCHEMA, encoder)}

    def plan(prompt: str, **kwargs):
        return parse_prompt(prompt, schemas, encoder, add_generation_prompt=True, **kwargs)

    def rendered(messages: list[dict[str, str]]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids

    return plan, rendered


@pytest.mark.parametrize("prompt", [
    '<prompt schema="kb"><cats/><user>Who sleeps?</user></prompt>',  # a final user turn (the README's shape)
    '<prompt schema="kb"><cats/><user>Who sleeps?</user><assistant/></prompt>',  # an explicit open turn
])
def test_last_user_turn_is_answered_as_the_chat_template_renders_it(chat, prompt):
    plan, rendered = chat
    result = plan(prompt)
    expected = rendered([SYSTEM, {"role": "user", "content": "Read the documents.Cats sleep most of the day."},
                         {"role": "user", "content": "Who sleeps?"}])
    assert result.token_ids() == expected
    assert result.generation_prompt_added is ("<assistant/>" not in prompt)


def test_question_inside_the_schema_user_turn_and_text_after_imports(chat):
    plan, rendered = chat
    inside = plan('<prompt schema="kb"><user><tea/>How hot?</user></prompt>')
    assert inside.generation_prompt_added and inside.is_exact and inside.token_ids() == rendered(
        [SYSTEM, {"role": "user", "content": "Read the documents.Tea is brewed with hot water.How hot?"}])
    imports_only = plan('<prompt schema="kb"><cats/><tea/></prompt>')
    assert imports_only.generation_prompt_added and imports_only.token_ids() == rendered(
        [SYSTEM, {"role": "user", "content": "Read the documents.Cats sleep most of the day."
                                             "Tea is brewed with hot water."}])
    text_after = plan('<prompt schema="kb"><cats/>Who sleeps?</prompt>')  # new text with no role
    assert text_after.generation_prompt_added and text_after.token_ids()[-len(imports_only.new_token_ids()):] == \
        imports_only.new_token_ids()


def test_an_open_assistant_turn_is_continued(chat):
    plan, rendered = chat
    turns = [SYSTEM, {"role": "user", "content": "Read the documents."}, {"role": "user", "content": "Hi"}]
    result = plan('<prompt schema="kb"><user>Hi</user><assistant>Sure,</assistant></prompt>')
    opened = rendered(turns)
    assert not result.generation_prompt_added
    assert result.token_ids()[:len(opened)] == opened and len(result.token_ids()) > len(opened)  # then "Sure,"
    spaced = plan('<prompt schema="kb"><user>Hi</user><assistant/> </prompt>')  # spaces after it: still last
    assert not spaced.generation_prompt_added and spaced.token_ids()[:len(opened)] == opened
    closed = plan('<prompt schema="kb"><user>Hi</user><assistant>Sure.</assistant><user>Thanks</user></prompt>')
    assert closed.generation_prompt_added and closed.token_ids() == rendered(
        [*turns, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Thanks"}])


def test_without_the_flag_nothing_is_added(encoder):
    schemas = {"kb": parse_schema(SCHEMA, encoder)}
    plan = parse_prompt('<prompt schema="kb"><user>Hi</user></prompt>', schemas, encoder)
    assert not plan.generation_prompt_added
    assert plan.new_token_ids()[-1] == encoder.encode("<|im_end|>\n")[-1]


def test_model_without_chat_template(tokenizer):
    """The plain format's `Assistant:` follows role turns; plain text with no roles anywhere stays a
    plain continuation (a base model completing text)."""
    encoder = TextEncoder.from_tokenizer(_tokenizer(None))
    schemas = {"plain": parse_schema('<schema name="plain"><module name="doc">Once upon a time</module></schema>',
                                     encoder)}
    story = parse_prompt('<prompt schema="plain"><doc/>, there was</prompt>', schemas, encoder,
                         add_generation_prompt=True)
    assert not story.generation_prompt_added and story.new_token_ids() == list(encoder.encode(", there was"))
    asked = parse_prompt('<prompt schema="plain"><doc/><user>Go on</user></prompt>', schemas, encoder,
                         add_generation_prompt=True)
    assert asked.generation_prompt_added and tokenizer.decode(asked.new_token_ids()).endswith("Go on\n\nAssistant:")


def test_template_that_cannot_be_split_adds_nothing(encoder):
    """Role tags are refused with such a template (ChatTemplateError); a plain prompt stays as written."""
    broken = TextEncoder(encode_fn=encoder.encode_fn, chat_format_error="the template moves the system prompt")
    schemas = {"s": parse_schema('<schema name="s"><module name="m">Text</module></schema>', broken)}
    plan = parse_prompt('<prompt schema="s"><m/>More</prompt>', schemas, broken, add_generation_prompt=True)
    assert not plan.generation_prompt_added


def test_an_empty_prompt_stays_empty(pml):
    from promptcache.pml import EmptyPromptError

    pml.schema('<schema name="opt"><module name="m">Optional</module></schema>')
    with pytest.raises(EmptyPromptError):
        pml.prompt('<prompt schema="opt"/>', add_generation_prompt=True)
