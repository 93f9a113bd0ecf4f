"""PML schema text -> validated Schema with its global position layout (docs/pml.md, "Positions")."""

from __future__ import annotations

from types import MappingProxyType

from lxml import etree

from promptcache.pml.errors import (
    FOLDED_SYSTEM,
    ChatTemplateError,
    InvalidNameError,
    InvalidParamError,
    PmlLimitError,
    SchemaError,
)
from promptcache.pml.schema import ROLE_TAGS, Module, Node, Param, RoleSection, Schema, TextRun, Union, check_name
from promptcache.pml.segments import ContextBudget, build_scaffolds, build_segments
from promptcache.pml.text_encoder import TextEncoder
from promptcache.pml.xml_reader import XML_SPACE, PmlLimits, TextItem, check_attributes, iter_content, parse_xml


def parse_schema(text: str, encoder: TextEncoder, limits: PmlLimits | None = None) -> Schema:
    """Parse and validate a PML schema, tokenize its text and lay out every position: text takes its tokens,
    a param its `len`, a module the sum of its children, a union the longest member, as running sums from 0
    (BOS first, if any). Raises a PmlError subclass naming the element and line for any invalid input."""
    limits = limits or PmlLimits()
    root = parse_xml(text, limits, max_bytes=limits.max_schema_bytes, what="schema")
    if root.tag != "schema":
        raise SchemaError(f"the root element is <{root.tag}>; expected <schema name=...>", line=root.sourceline)
    check_attributes(root, {"name", "params"})
    name = check_name(root.get("name"), element="schema", line=root.sourceline)
    params = root.get("params", "placeholder")
    if params not in ("placeholder", "skip"):
        raise SchemaError(f'<schema params={params!r}>: expected "placeholder" (encode module text after a '
                          'slot with placeholder tokens in it) or "skip" (encode it without the slot)',
                          line=root.sourceline)
    return _SchemaBuilder(encoder, limits).build(root, name, text, placeholders=params == "placeholder")


class _SchemaBuilder:
    def __init__(self, encoder: TextEncoder, limits: PmlLimits) -> None:
        self.encoder = encoder
        self.limits = limits
        self.modules: dict[str, Module] = {}
        self.sections: dict[int, RoleSection] = {}
        self.scaffold_elements: list[etree._Element] = []
        self.start = len(encoder.bos_token_ids)  # the first position after BOS: text there starts the sequence
        self.system_end: int | None = None  # where a folded system section ends (ChatFormat.folds_system)
        self.folded_user_follows = False  # a root user section starts there

    def build(self, element: etree._Element, name: str, text: str, *, placeholders: bool) -> Schema:
        bos = self.encoder.bos_token_ids
        head: tuple[Node, ...] = (TextRun(bos, 0, element.sourceline),) if bos else ()
        root = self._module(element, name=name, path="", cursor=len(bos), is_cached=True, lead=head, is_root=True)
        if self.system_end is not None and not self.folded_user_follows and self.system_end != root.end:
            raise ChatTemplateError(f"{FOLDED_SYSTEM}: put a <user> section right after <system>, or end the schema "
                                    "with it (the prompt then opens the user turn)", line=element.sourceline)
        if root.end > self.limits.max_schema_tokens:
            raise PmlLimitError(f"schema {name!r} spans {root.end} token positions; the limit is "
                                f"{self.limits.max_schema_tokens}")
        modules = MappingProxyType(dict(sorted(self.modules.items(), key=lambda kv: (kv[1].start, kv[0]))))
        budget = ContextBudget(self.limits.max_context_ids)
        segments = build_segments(root, self.encoder.placeholder_id if placeholders else None, budget)
        if len(self.scaffold_elements) > self.limits.max_scaffolds:
            raise PmlLimitError(f"the schema declares {len(self.scaffold_elements)} scaffolds; the limit is "
                                f"{self.limits.max_scaffolds}", line=self.scaffold_elements[-1].sourceline)
        scaffolds = build_scaffolds(self.scaffold_elements, modules, segments, budget)
        return Schema(name=name, pml=text, root=root, modules=modules, segments=segments, scaffolds=scaffolds,
                      role_sections=MappingProxyType(dict(self.sections)), num_positions=root.end)

    # A module's content: text, nested modules, unions, params, role sections (scaffolds at the root).
    def _module(self, element: etree._Element, *, name: str, path: str, cursor: int, is_cached: bool,
                parent_path: str | None = None, lead: tuple[Node, ...] = (), is_root: bool = False) -> Module:
        scope: dict[str, Module] = {}
        params: dict[str, Param] = {}
        unions: list[Union] = []
        children, end = self._content(element, path=path, cursor=cursor, is_cached=is_cached, scope=scope,
                                      params=params, unions=unions, role=None, is_root=is_root)
        self.modules[path] = module = Module(
            name=name, path=path, parent_path=parent_path, children=lead + children, start=0 if is_root else cursor,
            end=end, is_cached=is_cached, line=element.sourceline, scope=MappingProxyType(scope),
            params=MappingProxyType(params), unions=tuple(unions))
        if len(self.modules) > self.limits.max_modules + 1:
            raise PmlLimitError(f"the schema declares more than {self.limits.max_modules} modules",
                                line=element.sourceline)
        return module

    def _content(self, element: etree._Element, *, path: str, cursor: int, is_cached: bool,
                 scope: dict[str, Module], params: dict[str, Param], unions: list[Union],
                 role: str | None, is_root: bool) -> tuple[tuple[Node, ...], int]:
        children: list[Node] = []
        for item in iter_content(element):
            if isinstance(item, TextItem):
                cursor = self._add_text(children, item.text, cursor, item.line)
                continue
            tag, line = item.tag, item.sourceline
            child: Module | Union | Param | RoleSection
            if tag == "module":
                child = self._child_module(item, parent=path, cursor=cursor, is_cached=is_cached,
                                           scope=scope, params=params)
            elif tag == "union":
                child = self._union(item, parent=path, cursor=cursor, is_cached=is_cached, scope=scope, params=params)
                unions.append(child)
            elif tag in ("param", "parameter"):
                child = self._param(item, module_path=path, cursor=cursor, scope=scope, params=params)
            elif tag in ROLE_TAGS:
                if role is not None:
                    raise SchemaError(f"<{tag}> cannot be nested inside <{role}>", line=line)
                child = self._role(item, path=path, cursor=cursor, is_cached=is_cached, scope=scope,
                                   params=params, unions=unions, is_root=is_root)
            elif tag == "scaffold":
                if not is_root or role is not None:
                    raise SchemaError("<scaffold> must be a direct child of <schema>", line=line)
                self.scaffold_elements.append(item)
                continue
            else:
                raise SchemaError(f"unknown element <{tag}>; expected one of <module>, <union>, <param>, "
                                  "<system>, <user>, <assistant>, <scaffold>, or text", line=line)
            children.append(child)
            cursor = child.end
        return tuple(children), cursor

    def _add_text(self, children: list[Node], text: str, cursor: int, line: int,
                  role_suffix_of: int | None = None) -> int:
        """Append `text`'s run at `cursor` to `children` unless it has no tokens; returns the run's end."""
        # Text first after BOS starts every sequence; other text tokenizes as after the text before it.
        is_first = cursor == self.start
        token_ids = self.encoder.encode(text, at_start=is_first)
        is_continuation = not is_first and not self.encoder.starts_alike(text, token_ids)
        if token_ids:
            children.append(TextRun(token_ids, cursor, line, role_suffix_of, is_continuation))
        return cursor + len(token_ids)

    def _child_module(self, element: etree._Element, *, parent: str, cursor: int, is_cached: bool,
                      scope: dict[str, Module], params: dict[str, Param]) -> Module:
        check_attributes(element, {"name", "cache", XML_SPACE})
        name = check_name(element.get("name"), element="module", line=element.sourceline)
        _claim(name, scope, params, element)
        cache = element.get("cache", "true")
        if cache not in ("true", "false"):
            raise SchemaError(f"<module name={name!r}> has cache={cache!r}; expected \"true\" or \"false\"",
                              line=element.sourceline)
        path = f"{parent}.{name}" if parent else name
        if path in self.modules:
            raise InvalidNameError(f"<module name={name!r}> has the dotted path {path!r}, which another "
                                   "module already has", line=element.sourceline)
        scope[name] = module = self._module(element, name=name, path=path, cursor=cursor, parent_path=parent,
                                            is_cached=is_cached and cache == "true")
        return module

    def _union(self, element: etree._Element, *, parent: str, cursor: int, is_cached: bool,
               scope: dict[str, Module], params: dict[str, Param]) -> Union:
        check_attributes(element, {"default", "scaffold"})
        members: list[Module] = []
        for item in iter_content(element):
            if isinstance(item, TextItem):
                raise SchemaError(f"<union> contains text {item.text[:40]!r}; a union holds only <module>s",
                                  line=item.line)
            if item.tag != "module":
                raise SchemaError(f"<union> contains <{item.tag}>; a union holds only <module>s", line=item.sourceline)
            members.append(self._child_module(item, parent=parent, cursor=cursor, is_cached=is_cached,
                                              scope=scope, params=params))
        if not members:
            raise SchemaError("<union> is empty; expected at least one <module>", line=element.sourceline)
        names = [m.name for m in members]
        for attribute in ("default", "scaffold"):
            value = element.get(attribute)
            if value is not None and value not in names:
                raise SchemaError(f"<union {attribute}={value!r}> names no member; members are {names}",
                                  line=element.sourceline)
        end = max(m.end for m in members)
        return Union(tuple(members), element.get("default"), cursor, end, element.sourceline, element.get("scaffold"))

    def _param(self, element: etree._Element, *, module_path: str, cursor: int,
               scope: dict[str, Module], params: dict[str, Param]) -> Param:
        tag, line = element.tag, element.sourceline
        if not module_path:
            raise InvalidParamError(f"<{tag}> must be inside a <module>", line=line)
        length_attr = "len" if tag == "param" else "length"
        check_attributes(element, {"name", length_attr, "scaffold"}, InvalidParamError)
        name = check_name(element.get("name"), element=tag, line=line)
        raw = element.get(length_attr)
        if raw is None or not raw.isdigit() or not 0 < int(raw) <= self.limits.max_param_len:
            raise InvalidParamError(f"<{tag} name={name!r}> needs {length_attr}=N with N a whole number "
                                    f"from 1 to {self.limits.max_param_len}, got {raw!r}", line=line)
        if len(element) or (element.text or "").strip():
            raise InvalidParamError(f"<{tag} name={name!r}> must be empty", line=line)
        # Stands in the slot only while modules are encoded; one longer than the slot keeps its first tokens.
        scaffold = element.get("scaffold") or ""
        scaffold_ids = self.encoder.encode(scaffold, at_start=cursor == self.start)[:int(raw)] if scaffold else ()
        _claim(name, scope, params, element)
        params[name] = param = Param(name, int(raw), cursor, line, module_path, scaffold_ids)
        return param

    def _role(self, element: etree._Element, *, path: str, cursor: int, is_cached: bool, scope: dict[str, Module],
              params: dict[str, Param], unions: list[Union], is_root: bool) -> RoleSection:
        check_attributes(element, {XML_SPACE})
        role, line = element.tag, element.sourceline
        fmt = self.encoder.role_format(line)
        section_id = len(self.sections)
        children: list[Node] = []
        prefix = fmt.prefixes[role]
        if fmt.folds_system and role == "system":
            if not is_root or self.sections:
                raise ChatTemplateError(f"{FOLDED_SYSTEM}: <system> must be the schema's first role section, "
                                        "outside modules", line=line)
        elif fmt.folds_system and role == "user" and cursor == self.system_end:
            if not is_root:
                raise ChatTemplateError(f"{FOLDED_SYSTEM}: the <user> section after <system> must be outside "
                                        "modules", line=line)
            prefix, self.folded_user_follows = fmt.user_prefix_after("system"), True
        end = self._add_text(children, prefix, cursor, line)
        inner, end = self._content(element, path=path, cursor=end, is_cached=is_cached, scope=scope,
                                   params=params, unions=unions, role=role, is_root=is_root)
        children.extend(inner)
        end = self._add_text(children, fmt.suffixes[role], end, line, role_suffix_of=section_id)
        self.sections[section_id] = section = RoleSection(role, section_id, path, tuple(children), cursor, end, line)
        if fmt.folds_system and role == "system":
            self.system_end = end
        return section


def _claim(name: str, scope: dict[str, Module], params: dict[str, Param], element: etree._Element) -> None:
    if name in scope or name in params:
        raise InvalidNameError(f"<{element.tag}> name {name!r} is already declared in this scope "
                               "(union members share their parent's scope)", line=element.sourceline)
