"""Token ids of plain prompts (completion text, chats): no PML, text reaches the tokenizer unchanged. Chats are
rendered by the model's chat template (as HF and vLLM do); a model without one gets PML's plain turn format."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from promptcache.model_runtime.errors import ChatRenderError, InvalidRequestError
from promptcache.pml import PLAIN_CHAT_FORMAT


def completion_tokens(tokenizer: Any, text: str) -> tuple[int, ...]:
    """`text` as the tokenizer encodes a whole sequence (with its BOS, if it adds one). Raises
    InvalidRequestError for text that is not valid Unicode."""
    _check_unicode(text, "the prompt")
    return tuple(tokenizer.encode(text, add_special_tokens=True))


def chat_tokens(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> tuple[int, ...]:
    """The conversation rendered with the generation prompt, then encoded without adding specials
    (the template writes them). Raises ChatRenderError when the template refuses the messages,
    InvalidRequestError for content that is not valid Unicode."""
    for i, message in enumerate(messages):
        _check_unicode(message["content"], f"message {i}'s content")
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as exc:  # templates raise arbitrary errors (jinja's raise_exception, type errors)
            raise ChatRenderError(f"the model's chat template refused these messages: {exc}") from None
    else:
        fmt = PLAIN_CHAT_FORMAT
        text = "".join(fmt.prefixes[m["role"]] + m["content"] + fmt.suffixes[m["role"]] for m in messages)
        text += fmt.generation_prompt
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def _check_unicode(text: str, what: str) -> None:
    """A lone surrogate (JSON's "\\ud800" decodes to one) is no character a tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"{what} is not valid Unicode text: lone surrogate "
                                  f"U+{ord(text[exc.start]):04X} at character {exc.start}") from None
