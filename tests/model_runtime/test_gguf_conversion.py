"""The chat templates a base model's GGUF gets at conversion: Gemma's renders as Google publishes it (the system text
opening the first user turn, user/model turns closed by <end_of_turn>, roles alternating); PML's role sections are
split from it with the system text folded into the first user turn."""

from __future__ import annotations

import pytest

from promptcache.model_runtime.loading.gguf_conversion import GEMMA_TEMPLATE
from promptcache.pml import ChatTemplateError
from promptcache.pml.chat_format import chat_format_from_tokenizer
from tests.model_factories import make_test_tokenizer


@pytest.fixture
def tokenizer():
    fresh = make_test_tokenizer.__wrapped__()  # the shared one must not change
    fresh.chat_template = GEMMA_TEMPLATE
    return fresh


def test_gemmas_template_renders_as_published(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi \n"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (f"{tokenizer.bos_token}<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n"
                    "<start_of_turn>model\n")
    with pytest.raises(Exception, match="alternate"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                                      tokenize=False)


def test_role_tags_fold_the_system_text_under_gemmas_template(tokenizer):
    """Its system text opens the first user turn (tests/pml/test_folded_system.py renders prompts with it)."""
    fmt = chat_format_from_tokenizer(tokenizer, adds_bos=True)
    assert fmt.folds_system and fmt.prefixes["system"] == fmt.prefixes["user"] == "<start_of_turn>user\n"
    assert fmt.generation_prompt == "<start_of_turn>model\n"


def test_a_template_that_drops_the_system_text_is_refused(tokenizer):
    tokenizer.chat_template = GEMMA_TEMPLATE.replace("messages[0]['content'] + '\n\n'", "''")
    with pytest.raises(ChatTemplateError, match="alters or drops message content"):
        chat_format_from_tokenizer(tokenizer, adds_bos=True)
