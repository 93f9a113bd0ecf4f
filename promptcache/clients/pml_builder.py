"""Build PML schemas and prompts from Python objects, with correct escaping."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from xml.sax.saxutils import escape, quoteattr

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")  # fullmatch: `$` lets a final "\n" through
RESERVED = frozenset({"schema", "prompt", "module", "union", "param", "parameter", "scaffold", "system", "user",
                      "assistant"})


def check_name(name: str) -> str:
    if not NAME.fullmatch(name) or name in RESERVED:
        raise ValueError(f"invalid PML name {name!r}: letters, digits, '_', '.', '-', not a PML tag name")
    return name


def render(content: str | Node | Sequence[str | Node]) -> str:
    if isinstance(content, str):
        return escape(content)
    if isinstance(content, Node):
        return content.to_pml()
    return "".join(render(part) for part in content)


class Node:
    def to_pml(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class Param(Node):
    name: str
    length: int

    def __post_init__(self) -> None:
        check_name(self.name)
        if self.length < 1:
            raise ValueError("a param needs length >= 1")

    def to_pml(self) -> str:
        return f"<param name={quoteattr(self.name)} len=\"{self.length}\"/>"


@dataclass(frozen=True)
class Module(Node):
    name: str
    content: str | Node | Sequence[str | Node] = ()
    cache: bool = True

    def __post_init__(self) -> None:
        check_name(self.name)

    def to_pml(self) -> str:
        cache = "" if self.cache else ' cache="false"'
        return f"<module name={quoteattr(self.name)}{cache}>{render(self.content)}</module>"


@dataclass(frozen=True)
class Union(Node):
    members: Sequence[Module]
    default: str | None = None

    def to_pml(self) -> str:
        default = f" default={quoteattr(self.default)}" if self.default else ""
        return f"<union{default}>{render(list(self.members))}</union>"


@dataclass(frozen=True)
class Role(Node):
    role: str
    content: str | Node | Sequence[str | Node] = ()

    def to_pml(self) -> str:
        inner = render(self.content)
        return f"<{self.role}>{inner}</{self.role}>" if inner else f"<{self.role}/>"


def System(content="") -> Role:
    return Role("system", content)


def User(content="") -> Role:
    return Role("user", content)


def Assistant(content="") -> Role:
    return Role("assistant", content)


def AssistantTurn(prefix: str = "") -> Role:
    """The open assistant turn at the end of a prompt (the generation prompt)."""
    return Role("assistant", prefix)


@dataclass(frozen=True)
class Scaffold(Node):
    modules: Sequence[str]

    def to_pml(self) -> str:
        return f"<scaffold modules={quoteattr(' '.join(self.modules))}/>"


@dataclass(frozen=True)
class Schema(Node):
    name: str
    content: Sequence[str | Node] = ()

    def __post_init__(self) -> None:
        check_name(self.name)

    def to_pml(self) -> str:
        return f"<schema name={quoteattr(self.name)}>{render(self.content)}</schema>"


@dataclass(frozen=True)
class Import(Node):
    """`<name arg="value">nested imports</name>` in a prompt."""

    name: str
    children: Sequence[Import] = ()
    args: dict[str, str] = field(default_factory=dict)

    def __init__(self, name: str, children: Sequence[Import] = (), **args: str) -> None:
        object.__setattr__(self, "name", check_name(name))
        object.__setattr__(self, "children", tuple(children))
        object.__setattr__(self, "args", {check_name(k): str(v) for k, v in args.items()})

    def to_pml(self) -> str:
        attrs = "".join(f" {k}={quoteattr(v)}" for k, v in self.args.items())
        inner = render(list(self.children))
        return f"<{self.name}{attrs}>{inner}</{self.name}>" if inner else f"<{self.name}{attrs}/>"


@dataclass(frozen=True)
class Prompt(Node):
    schema: str
    content: Sequence[str | Node] = ()

    def to_pml(self) -> str:
        return f"<prompt schema={quoteattr(self.schema)}>{render(self.content)}</prompt>"
