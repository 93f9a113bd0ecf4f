"""Per-role chat markup, derived from a tokenizer's own chat template by rendering sentinels."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from promptcache.pml.errors import ChatTemplateError

ROLES = ("system", "user", "assistant")
_SENTINELS = {f"{role}{i}": f"PMLSENTINEL{role.upper()}{i}X" for role in ROLES for i in range(2)}


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """The text a role section is wrapped in: `prefixes[role] + content + suffixes[role]`. `generation_prompt`
    opens the assistant turn the model is asked to write; `is_fallback`: the plain format (no chat template)."""

    prefixes: Mapping[str, str]
    suffixes: Mapping[str, str]
    generation_prompt: str
    is_fallback: bool = False

    def __post_init__(self) -> None:
        for role in ROLES:
            if role not in self.prefixes or role not in self.suffixes:
                raise ValueError(f"ChatFormat needs a prefix and a suffix for role {role!r}")
        object.__setattr__(self, "prefixes", MappingProxyType(dict(self.prefixes)))
        object.__setattr__(self, "suffixes", MappingProxyType(dict(self.suffixes)))


# Used when a tokenizer has no chat template (base models): readable turn labels, blank-line separated.
PLAIN_CHAT_FORMAT = ChatFormat(prefixes={"system": "", "user": "User: ", "assistant": "Assistant: "},
                               suffixes=dict.fromkeys(ROLES, "\n\n"), generation_prompt="Assistant:", is_fallback=True)


def chat_format_from_tokenizer(tokenizer: Any, *, adds_bos: bool = False) -> ChatFormat:
    """Derive the per-role markup from a Hugging Face tokenizer's chat template, rendered around sentinel
    contents and split on them (never inserting a default system prompt). With `adds_bos`, the template's
    leading BOS is left out. Templates a longer conversation shows cannot be split per role (e.g. ones moving
    the system prompt into the first user turn) raise ChatTemplateError."""
    if not getattr(tokenizer, "chat_template", None):
        return PLAIN_CHAT_FORMAT
    s = _SENTINELS
    full = _render(tokenizer, [("system", s["system0"]), ("user", s["user0"]), ("assistant", s["assistant0"]),
                               ("user", s["user1"]), ("assistant", s["assistant1"])], generation=False)
    sys_only = _render(tokenizer, [("system", s["system0"])], generation=False)
    sys_user = _render(tokenizer, [("system", s["system0"]), ("user", s["user0"])], generation=False)
    with_gen = _render(tokenizer, [("system", s["system0"]), ("user", s["user0"])], generation=True)
    head, sys_rest = _split_once(full, s["system0"])
    bos = (getattr(tokenizer, "bos_token", None) or "") if adds_bos else ""
    system_prefix = head[len(bos):] if bos and head.startswith(bos) else head
    between_sys_user, rest = _split_once(sys_rest, s["user0"])
    between_user_asst, rest = _split_once(rest, s["assistant0"])
    between_asst_user, rest = _split_once(rest, s["user1"])
    between_user_asst2, assistant_suffix = _split_once(rest, s["assistant1"])
    system_suffix = _split_once(sys_only, s["system0"])[1]
    user_suffix = _split_once(sys_user, s["user0"])[1]
    user_prefix = _strip_prefix(between_sys_user, system_suffix, "system suffix")
    assistant_prefix = _strip_prefix(between_user_asst, user_suffix, "user suffix")
    generation_prompt = _strip_prefix(_split_once(with_gen, s["user0"])[1], user_suffix, "user suffix")
    # The same pieces must rebuild the turns between later messages too.
    if between_asst_user != assistant_suffix + user_prefix or between_user_asst2 != user_suffix + assistant_prefix:
        raise ChatTemplateError("the tokenizer's chat template does not wrap each message in a fixed "
                                "per-role prefix and suffix; use a schema without role tags")
    return ChatFormat(prefixes={"system": system_prefix, "user": user_prefix, "assistant": assistant_prefix},
                      suffixes={"system": system_suffix, "user": user_suffix, "assistant": assistant_suffix},
                      generation_prompt=generation_prompt)


def _render(tokenizer: Any, messages: list[tuple[str, str]], *, generation: bool) -> str:
    try:
        text: str = tokenizer.apply_chat_template([{"role": role, "content": content} for role, content in messages],
                                                  tokenize=False, add_generation_prompt=generation)
    except Exception as exc:  # templates raise arbitrary errors (jinja, raise_exception)
        raise ChatTemplateError(f"rendering the tokenizer's chat template failed: {exc}") from None
    return text


def _split_once(text: str, sentinel: str) -> tuple[str, str]:
    if text.count(sentinel) != 1:
        raise ChatTemplateError("the tokenizer's chat template alters or drops message content; "
                                "role tags need a template that copies content verbatim")
    before, after = text.split(sentinel)
    return before, after


def _strip_prefix(text: str, prefix: str, what: str) -> str:
    if not text.startswith(prefix):
        raise ChatTemplateError(f"the chat template's {what} is not followed by a fixed role prefix")
    return text[len(prefix):]
