"""Role tags under a chat template that writes the system text into the first user turn (Gemma's: no system turn of
its own). Oracle: the tokenizer's own `apply_chat_template(..., add_generation_prompt=True)` on the same messages;
layouts the template cannot express are refused with ChatTemplateError naming the rule."""

from __future__ import annotations

import pytest

from promptcache.model_runtime.loading.gguf_conversion import GEMMA_TEMPLATE
from promptcache.pml import ChatTemplateError, TextEncoder, parse_prompt, parse_schema
from tests.model_factories import make_test_tokenizer
from tests.pml.test_generation_prompt import SCHEMA as SECTIONS  # schema "kb": <system>, then a <user> section

SYSTEM = "You are a helpful assistant."
SYSTEM_ONLY = f'<schema name="persona"><system>{SYSTEM}</system></schema>'
DOCS_FIRST = f"""<schema name="notes">
    <module name="cats">Cats sleep most of the day.</module>
    <system>{SYSTEM}</system>
</schema>"""
NO_ROLES = '<schema name="plain"><module name="cats">Cats sleep most of the day.</module></schema>'


@pytest.fixture(scope="module")
def gemma():
    tokenizer = make_test_tokenizer.__wrapped__()  # the shared one must not change
    tokenizer.chat_template = GEMMA_TEMPLATE
    encoder = TextEncoder.from_tokenizer(tokenizer)
    texts = (SECTIONS, SYSTEM_ONLY, DOCS_FIRST, NO_ROLES)
    schemas = {schema.name: schema for schema in (parse_schema(text, encoder) for text in texts)}

    def plan(prompt: str):
        return parse_prompt(prompt, schemas, encoder, add_generation_prompt=True)

    def rendered(*turns: tuple[str, str]) -> list[int]:
        text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in turns], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids

    return encoder, plan, rendered


def test_the_format_folds_the_system_text_into_the_user_turn(gemma):
    encoder, _, _ = gemma
    fmt = encoder.chat_format
    assert encoder.chat_format_error is None and fmt.folds_system
    assert fmt.prefixes["user"] == "<start_of_turn>user\n" and fmt.suffixes["system"] == "\n\n"
    assert fmt.user_prefix_after("system") == "" and fmt.user_prefix_after("assistant") == fmt.prefixes["user"]


def test_a_schema_user_section_after_system_shares_its_turn(gemma):
    _, plan, rendered = gemma
    result = plan('<prompt schema="kb"><user><tea/>How hot?</user></prompt>')
    assert result.is_exact and result.generation_prompt_added
    assert result.token_ids() == rendered(("system", SYSTEM), ("user", "Read the documents.Tea is brewed with hot "
                                                                       "water.How hot?"))
    chat = plan('<prompt schema="kb"><user><cats/>Who sleeps?</user><assistant>Cats.</assistant><user>Why?</user>'
                '</prompt>')  # a later user turn keeps its prefix
    assert chat.token_ids() == rendered(("system", SYSTEM), ("user", "Read the documents.Cats sleep most of the day."
                                                                     "Who sleeps?"),
                                        ("assistant", "Cats."), ("user", "Why?"))


def test_a_schema_ending_in_system_opens_the_prompts_first_user_turn(gemma):
    _, plan, rendered = gemma
    one = plan('<prompt schema="persona"><user>Who sleeps?</user></prompt>')
    assert one.token_ids() == rendered(("system", SYSTEM), ("user", "Who sleeps?"))
    chat = plan('<prompt schema="persona"><user>Hi</user><assistant>Hello.</assistant><user>Bye</user></prompt>')
    assert chat.token_ids() == rendered(("system", SYSTEM), ("user", "Hi"), ("assistant", "Hello."), ("user", "Bye"))


def test_plain_text_stays_a_continuation(gemma):
    """As without a chat template: no turn is opened after a prompt with no role tags in a schema without any (a base
    Gemma GGUF gets this template at conversion; its completion-style prompts stay completions)."""
    encoder, plan, _ = gemma
    result = plan('<prompt schema="plain"><cats/> They dream.</prompt>')
    assert not result.generation_prompt_added
    assert result.token_ids() == [*encoder.encode("Cats sleep most of the day."), *encoder.encode(" They dream.")]
    assert plan('<prompt schema="plain"><cats/><user>Who?</user></prompt>').generation_prompt_added


def test_a_prompt_system_turn_opens_the_user_turn_after_it(gemma):
    _, plan, rendered = gemma
    result = plan('<prompt schema="plain"><system>Be brief.</system><user>Hi</user></prompt>')
    assert result.token_ids() == rendered(("system", "Be brief."), ("user", "Hi"))


@pytest.mark.parametrize(("schema", "message"), [
    ('<schema name="s"><user>Hi</user><system>Be brief.</system></schema>', "first role section"),
    ('<schema name="s"><module name="m"><system>Be brief.</system></module></schema>', "first role section"),
    ('<schema name="s"><system>Be brief.</system><module name="m">Text.</module></schema>', "right after"),
    ('<schema name="s"><system>Be brief.</system><module name="m"><user>Hi</user></module></schema>',
     "outside modules"),
])
def test_schemas_the_template_cannot_express_are_refused(gemma, schema, message):
    encoder, _, _ = gemma
    with pytest.raises(ChatTemplateError, match=message):
        parse_schema(schema, encoder)


@pytest.mark.parametrize(("prompt", "message"), [
    ('<prompt schema="notes"><cats/></prompt>', "follow the system text with a <user> turn"),
    ('<prompt schema="persona">Note.<user>Hi</user></prompt>', "follow the system text with a <user> turn"),
    ('<prompt schema="notes"><user>Hi</user><cats/></prompt>', "import modules before"),
    ('<prompt schema="plain"><system>Be brief.</system><assistant>A</assistant><user>B</user></prompt>',
     "turn after <system> must be <user>"),
    ('<prompt schema="plain"><user>Hi</user><system>Be brief.</system></prompt>', "first text"),
    ('<prompt schema="kb"><system>Be brief.</system><user>Hi</user></prompt>', "schema without <system>"),
])
def test_prompts_the_template_cannot_express_are_refused(gemma, prompt, message):
    _, plan, _ = gemma
    with pytest.raises(ChatTemplateError, match=message):
        plan(prompt)


LLAMA2_TEMPLATE = (  # Llama-2-chat's shape: the system text inside the first [INST], between <<SYS>> markers
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' }}{% if loop.first and system %}"
    "{{ '<<SYS>>' + system + '<</SYS>> ' }}{% endif %}{{ m['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + ' </s>' }}{% endif %}{% endfor %}")


def test_another_folding_template_renders_as_itself():
    """Not only Gemma's: a Llama-2-chat-shaped template folds too, and a conversation renders as it does."""
    tokenizer = make_test_tokenizer.__wrapped__()
    tokenizer.chat_template = LLAMA2_TEMPLATE
    encoder = TextEncoder.from_tokenizer(tokenizer)
    assert encoder.chat_format.folds_system and encoder.chat_format.prefixes["system"] == "[INST] <<SYS>>"
    schemas = {"kb": parse_schema(SECTIONS, encoder)}
    result = parse_prompt('<prompt schema="kb"><user><tea/>How hot?</user><assistant>Very.</assistant>'
                          '<user>Why?</user></prompt>', schemas, encoder)
    text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {
        "role": "user", "content": "Read the documents.Tea is brewed with hot water.How hot?"},
        {"role": "assistant", "content": "Very."}, {"role": "user", "content": "Why?"}], tokenize=False)
    assert result.token_ids() == tokenizer(text, add_special_tokens=False).input_ids
