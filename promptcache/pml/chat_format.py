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
    opens the assistant turn the model is asked to write; `is_fallback`: the plain format (no chat template).
    `folds_system`: the template writes the system text at the start of the first user turn (Gemma's): the system
    prefix opens that turn, the system suffix separates the two texts, and the user turn right after the system turn
    has no prefix of its own (`user_prefix_after`); a system turn is then valid only first and followed by a user
    turn (pml checks where it places them)."""

    prefixes: Mapping[str, str]
    suffixes: Mapping[str, str]
    generation_prompt: str
    is_fallback: bool = False
    folds_system: bool = False

    def __post_init__(self) -> None:
        for role in ROLES:
            if role not in self.prefixes or role not in self.suffixes:
                raise ValueError(f"ChatFormat needs a prefix and a suffix for role {role!r}")
        object.__setattr__(self, "prefixes", MappingProxyType(dict(self.prefixes)))
        object.__setattr__(self, "suffixes", MappingProxyType(dict(self.suffixes)))

    def user_prefix_after(self, previous_role: str | None) -> str:
        """The prefix of a user turn that directly follows a `previous_role` turn (None: anything else)."""
        return "" if self.folds_system and previous_role == "system" else self.prefixes["user"]


# Used when a tokenizer has no chat template (base models): readable turn labels, blank-line separated.
PLAIN_CHAT_FORMAT = ChatFormat(prefixes={"system": "", "user": "User: ", "assistant": "Assistant: "},
                               suffixes=dict.fromkeys(ROLES, "\n\n"), generation_prompt="Assistant:", is_fallback=True)


def chat_format_from_tokenizer(tokenizer: Any, *, adds_bos: bool = False) -> ChatFormat:
    """Derive the per-role markup from a Hugging Face tokenizer's chat template, rendered around sentinel
    contents and split on them (never inserting a default system prompt). With `adds_bos`, the template's
    leading BOS is left out. A template that writes the system text into the first user turn gives a format that
    `folds_system`; templates a longer conversation shows cannot be split per role raise ChatTemplateError."""
    if not getattr(tokenizer, "chat_template", None):
        return PLAIN_CHAT_FORMAT
    s = _SENTINELS
    full = _render(tokenizer, [("system", s["system0"]), ("user", s["user0"]), ("assistant", s["assistant0"]),
                               ("user", s["user1"]), ("assistant", s["assistant1"])], generation=False)
    sys_only = _render(tokenizer, [("system", s["system0"])], generation=False)
    bos = (getattr(tokenizer, "bos_token", None) or "") if adds_bos else ""
    if s["system0"] not in sys_only and s["system0"] in full:  # rendered only with the user turn it opens
        return _folded_format(tokenizer, full, bos)
    sys_user = _render(tokenizer, [("system", s["system0"]), ("user", s["user0"])], generation=False)
    with_gen = _render(tokenizer, [("system", s["system0"]), ("user", s["user0"])], generation=True)
    head, sys_rest = _split_once(full, s["system0"])
    system_prefix = _without(head, bos)
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


def _folded_format(tokenizer: Any, full: str, bos: str) -> ChatFormat:
    """The format of a template that folds the system text into the first user turn: the user and assistant pieces
    from a conversation without a system turn (the user prefix as a later turn has it: text the template writes
    only at the start, such as a BOS the tokenizer does not add, goes with the system prefix as in the unfolded
    format), the system's from `full` (system, user, assistant, user, assistant), which they must rebuild exactly."""
    s = _SENTINELS
    plain = _render(tokenizer, [("user", s["user0"]), ("assistant", s["assistant0"]), ("user", s["user1"]),
                                ("assistant", s["assistant1"])], generation=False)
    rest = _split_once(plain, s["user0"])[1]
    between_user_asst, rest = _split_once(rest, s["assistant0"])
    between_asst_user, rest = _split_once(rest, s["user1"])
    between_user_asst2, assistant_suffix = _split_once(rest, s["assistant1"])
    user_prefix = _strip_prefix(between_asst_user, assistant_suffix, "assistant suffix")
    user_suffix = _split_once(_render(tokenizer, [("user", s["user0"])], generation=False), s["user0"])[1]
    with_gen = _render(tokenizer, [("user", s["user0"])], generation=True)
    assistant_prefix = _strip_prefix(between_user_asst, user_suffix, "user suffix")
    generation_prompt = _strip_prefix(_split_once(with_gen, s["user0"])[1], user_suffix, "user suffix")
    system_head, system_rest = _split_once(full, s["system0"])
    system_prefix = _without(system_head, bos)
    system_suffix = _split_once(system_rest, s["user0"])[0]
    turns = (s["user0"] + user_suffix + assistant_prefix + s["assistant0"] + assistant_suffix + user_prefix
             + s["user1"] + user_suffix + assistant_prefix + s["assistant1"] + assistant_suffix)
    if (between_user_asst2 != user_suffix + assistant_prefix or not plain.endswith(user_prefix + turns)
            or _without(full, bos) != system_prefix + s["system0"] + system_suffix + turns):
        raise ChatTemplateError("the tokenizer's chat template does not wrap each message in a fixed "
                                "per-role prefix and suffix; use a schema without role tags")
    return ChatFormat(prefixes={"system": system_prefix, "user": user_prefix, "assistant": assistant_prefix},
                      suffixes={"system": system_suffix, "user": user_suffix, "assistant": assistant_suffix},
                      generation_prompt=generation_prompt, folds_system=True)


def _without(text: str, bos: str) -> str:
    """`text` without a leading `bos` (the tokenizer adds it: never part of a role's markup)."""
    return text[len(bos):] if bos and text.startswith(bos) else text


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
