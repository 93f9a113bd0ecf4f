"""Build PML schemas and prompts from Python objects, with correct escaping, or from `@prompt` programs."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
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


@dataclass
class _Node:
    kind: str  # "root" | "module" | "union" | "role" | "text" | "param" | "ask"
    name: str = ""
    when: bool = True
    text: str = ""
    length: int = 0
    value: str | None = None
    default: str | None = None
    children: list[_Node] = field(default_factory=list)


class Recorder:
    """What a prompt program writes into (the `p` argument)."""

    def __init__(self) -> None:
        self.root = _Node("root")
        self._stack = [self.root]

    def _add(self, node: _Node) -> None:
        self._stack[-1].children.append(node)

    @contextmanager
    def _enter(self, node: _Node) -> Iterator[None]:
        self._add(node)
        self._stack.append(node)
        try:
            yield
        finally:
            self._stack.pop()

    def text(self, text: str) -> None:
        self._add(_Node("text", text=text))

    def ask(self, text: str) -> None:
        self._add(_Node("ask", text=text))

    def param(self, name: str, *, max_len: int, value: Any = None) -> None:
        if max_len < 1:
            raise ValueError("max_len must be >= 1")
        self._add(_Node("param", name=check_name(name), length=max_len, value=None if value is None else str(value)))

    def module(self, name: str, *, when: bool = True):
        return self._enter(_Node("module", name=check_name(name), when=bool(when)))

    def union(self, name: str = "", *, default: str | None = None):
        return self._enter(_Node("union", name=name, default=default))

    def case(self, name: str, *, when: bool = False):
        if self._stack[-1].kind != "union":
            raise ValueError("p.case(...) belongs inside `with p.union(...)`")
        return self._enter(_Node("module", name=check_name(name), when=bool(when)))

    def system(self):
        return self._enter(_Node("role", name="system"))

    def user(self):
        return self._enter(_Node("role", name="user"))

    def assistant(self):
        return self._enter(_Node("role", name="assistant"))

    def call(self, program: PromptProgram, *, when: bool = True, **kwargs: Any) -> None:
        """A call to another prompt program: its content becomes a nested module."""
        with self.module(program.name, when=when):
            program.fn(self, **kwargs)


class PromptProgram:
    """A decorated prompt function. Call `schema_pml()` once to upload, `prompt_pml(**kwargs)` per request."""

    def __init__(self, fn: Callable[..., None], name: str, schema_defaults: dict[str, Any]) -> None:
        self.fn = fn
        self.name = check_name(name)
        self.schema_defaults = schema_defaults
        functools.update_wrapper(self, fn)

    def schema_pml(self) -> str:
        recorder = Recorder()
        self.fn(recorder, **self.schema_defaults)
        return f"<schema name={quoteattr(self.name)}>{_schema(recorder.root)}</schema>"

    def prompt_pml(self, *, generate: bool = True, **kwargs: Any) -> str:
        recorder = Recorder()
        self.fn(recorder, **{**self.schema_defaults, **kwargs})
        tail = "<assistant/>" if generate else ""
        return f"<prompt schema={quoteattr(self.name)}>{_prompt(recorder.root)}{tail}</prompt>"

    def __call__(self, **kwargs: Any) -> str:
        return self.prompt_pml(**kwargs)


def prompt(name: str | None = None, **schema_defaults: Any) -> Callable[[Callable[..., None]], PromptProgram]:
    """Decorator: a prompt function becomes a PML schema plus a prompt builder (paper §3.2.4), as in
    `@prompt("trip", duration="", destination="")` (defaults used when building the schema). The function writes
    into a Recorder `p`: `p.text(...)` (fixed text); `with p.module(name, when=cond):` (an `if`); `with
    p.union(name):` + `with p.case(member, when=cond):` (if/elif/else, match); `p.call(program, **kwargs)` (a nested
    module); `p.param(name, max_len=N, value=...)`; role sections `with p.user():`; `p.ask(text)` (new text, never
    cached). `schema_pml()` records every branch; `prompt_pml(**kwargs)` emits the imports whose conditions held."""

    def wrap(fn: Callable[..., None]) -> PromptProgram:
        return PromptProgram(fn, name or fn.__name__.replace("_", "-"), schema_defaults)

    return wrap


def _schema(node: _Node) -> str:
    out = []
    for child in node.children:
        if child.kind == "text":
            out.append(escape(child.text))
        elif child.kind == "param":
            out.append(f"<param name={quoteattr(child.name)} len=\"{child.length}\"/>")
        elif child.kind == "module":
            out.append(f"<module name={quoteattr(child.name)}>{_schema(child)}</module>")
        elif child.kind == "union":
            default = f" default={quoteattr(child.default)}" if child.default else ""
            out.append(f"<union{default}>{_schema(child)}</union>")
        elif child.kind == "role":
            out.append(f"<{child.name}>{_schema(child)}</{child.name}>")
    return "".join(out)


def _prompt(node: _Node) -> str:
    out = []
    for child in node.children:
        if child.kind == "ask":
            out.append(escape(child.text))
        elif child.kind == "module" and child.when:
            args = "".join(f" {p.name}={quoteattr(p.value)}" for p in child.children if p.kind == "param" and p.value)
            inner = _prompt(child)
            out.append(f"<{child.name}{args}>{inner}</{child.name}>" if inner else f"<{child.name}{args}/>")
        elif child.kind == "union":
            out.append(_prompt(child))
        elif child.kind == "role" and (inner := _prompt(child)):
            out.append(f"<{child.name}>{inner}</{child.name}>")
    return "".join(out)
