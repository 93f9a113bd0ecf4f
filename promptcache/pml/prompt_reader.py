"""Read a `<prompt>` document against its schema: imports, arguments and role elements resolved into items in
document order; placement (prompt_parser) assigns positions."""

from __future__ import annotations

from dataclasses import dataclass, field

from lxml import etree

from promptcache.pml.errors import (
    FOLDED_SYSTEM,
    ArgumentTooLongError,
    ChatTemplateError,
    DuplicateImportError,
    PromptError,
    UnknownModuleError,
    UnknownParamError,
)
from promptcache.pml.plan import NewRun
from promptcache.pml.schema import ROLE_TAGS, Module, RoleSection, Schema, Union
from promptcache.pml.text_encoder import TextEncoder
from promptcache.pml.xml_reader import XML_SPACE, TextItem, iter_content


@dataclass(slots=True)
class ImportItem:
    """One top-level import (with its nested imports): modules included and argument runs."""

    module_paths: list[str]
    arguments: list[NewRun]
    line: int


@dataclass(slots=True)
class TextPiece:
    """New text to place. `after_section` is set for the tail of a bound role element; `text` is what
    `token_ids` encode (re-encoded if the piece turns out to start the sequence)."""

    token_ids: tuple[int, ...]
    kind: str  # "text" | "role"
    line: int
    snippet: str
    after_section: int | None = None
    text: str = ""
    is_generation_prompt: bool = False


@dataclass(slots=True)
class PromptItems:
    items: list[ImportItem | TextPiece] = field(default_factory=list)
    imported: dict[str, int] = field(default_factory=dict)  # module path -> line
    displaced_sections: set[int] = field(default_factory=set)
    # Default members of root-level unions the prompt did not choose: included, but not a placement anchor.
    implicit: ImportItem = field(default_factory=lambda: ImportItem([], [], 0))
    # Argument source ("module.param") -> (the param's length, the value): for re-encoding.
    argument_values: dict[str, tuple[int, str]] = field(default_factory=dict)
    generation_prompt_added: bool = False  # the last item opens the assistant turn


class PromptReader:
    """Walks a prompt element; one instance per prompt."""

    def __init__(self, schema: Schema, encoder: TextEncoder) -> None:
        self.schema = schema
        self.encoder = encoder
        self.out = PromptItems()
        self.union_choice: dict[int, str] = {}  # id(Union) -> chosen member path
        self.section_of = _sections_by_module(schema)
        # Indexed once: a scan of the schema per import would make a prompt importing many modules quadratic.
        self.union_of = {id(member): union for module in schema.modules.values() for union in module.unions
                         for member in union.members}
        self.suffix_of = {s.role_suffix_of: s.segment_id for s in schema.segments if s.role_suffix_of is not None}
        # A template that folds the system text into the first user turn (ChatFormat.folds_system): whether the
        # schema ends in that system section, where a prompt system turn is, and the user turn that follows either.
        self.folds = encoder.chat_format_error is None and encoder.chat_format.folds_system
        self.system_open = self.folds and any(
            s.role == "system" and s.end == schema.num_positions for s in schema.role_sections.values())
        self.system_turn: int | None = None  # item index
        self.folded_user: int | None = None  # item index

    def read(self, root: etree._Element, *, add_generation_prompt: bool = False) -> PromptItems:
        """The prompt's items in document order. `add_generation_prompt`: unless the prompt ends in an
        open assistant turn (a final `<assistant>` that imports nothing), a last item opens one."""
        content = list(iter_content(root))
        # Spaces after the last element (`<assistant/> </prompt>`) do not make it any less the last.
        last = next((c for c in reversed(content) if not isinstance(c, TextItem) or c.text.strip()), None)
        for item in content:
            if isinstance(item, TextItem):
                self._text(item.text, item.line)
            elif item.tag in ROLE_TAGS:
                self._role(item, is_last=item is last)
            else:
                self.out.items.append(self._import_top(item))
        self._apply_union_defaults(self.schema.root, self.out.implicit)
        is_open = isinstance(last, etree._Element) and last.tag == "assistant" and not any(
            isinstance(c, etree._Element) for c in last)
        if self.folds:
            self._check_folded_system(root.sourceline)
        if add_generation_prompt and not is_open:
            self._open_generation_prompt(root.sourceline, uses_roles=any(
                isinstance(c, etree._Element) and c.tag in ROLE_TAGS for c in content))
        return self.out

    def _check_folded_system(self, line: int) -> None:
        """Under a template that writes the system text into the first user turn, that user turn exists and follows
        the system text directly: new turns and imports placed after it would come between them."""
        if (self.system_open or self.system_turn is not None) and self.folded_user is None:
            raise ChatTemplateError(f"{FOLDED_SYSTEM}: follow the system text with a <user> turn", line=line)
        if self.folded_user is not None and any(isinstance(item, ImportItem)
                                                for item in self.out.items[self.folded_user:]):
            raise ChatTemplateError(f"{FOLDED_SYSTEM}: import modules before the <user> turn it opens (imports "
                                    "after it are placed before the system text)", line=line)

    def _open_generation_prompt(self, line: int, *, uses_roles: bool) -> None:
        # Without a chat template, or under one that folds the system turn (Gemma's, which promptcache also gives a
        # base Gemma GGUF that has none), only where the prompt or its schema has role turns: plain text stays plain.
        fmt = self.encoder.chat_format
        if self.encoder.chat_format_error is not None or not fmt.generation_prompt or (
                (fmt.is_fallback or fmt.folds_system) and not uses_roles and not self.schema.role_sections):
            return
        tokens = self.encoder.encode(fmt.generation_prompt)
        self.out.items.append(TextPiece(tokens, "role", line, fmt.generation_prompt[:40],
                                        text=fmt.generation_prompt, is_generation_prompt=True))
        self.out.generation_prompt_added = True

    def _text(self, text: str, line: int, kind: str = "text") -> None:
        self.out.items.append(TextPiece(self.encoder.encode(text), kind, line, text[:40], text=text))

    def _role(self, element: etree._Element, *, is_last: bool) -> None:
        role, line = element.tag, element.sourceline
        if set(element.attrib) - {XML_SPACE}:
            raise PromptError(f"<{role}> takes no attributes in a prompt (except xml:space)", line=line)
        content = list(iter_content(element))
        imports = [c for c in content if not isinstance(c, TextItem)]
        if not imports:
            self._new_turn(role, "".join(c.text for c in content), line, is_last=is_last)
            return
        section = self._bound_section(role, imports)
        last_import = max(i for i, c in enumerate(content) if not isinstance(c, TextItem))
        for index, item in enumerate(content):
            if isinstance(item, TextItem) and index > last_import:
                # Text inside the schema's own turn: the turn's cached closing markup moves behind it.
                assert section.section_id in self.suffix_of, "role sections always end with a suffix segment"
                suffix = self.schema.segments[self.suffix_of[section.section_id]].token_ids
                self.out.displaced_sections.add(section.section_id)
                tokens = self.encoder.encode(item.text) + suffix
                self.out.items.append(TextPiece(tokens, "text", item.line, item.text[:40],
                                                after_section=section.section_id))
            elif isinstance(item, TextItem):
                self._text(item.text, item.line)
            else:
                self.out.items.append(self._import_top(item))

    def _new_turn(self, role: str, text: str, line: int, *, is_last: bool) -> None:
        fmt = self.encoder.role_format(line)
        is_open = role == "assistant" and is_last  # an open turn for the model to continue
        prefix = self._folded_prefix(role, line) if self.folds else fmt.prefixes[role]
        markup = fmt.generation_prompt + text if is_open else prefix + text + fmt.suffixes[role]
        self._text(markup, line, kind="role")

    def _folded_prefix(self, role: str, line: int) -> str:
        """A new turn's prefix under a template that folds the system text into the first user turn: a system turn
        only as the prompt's first text, in a schema without one; the user turn right after the system text (the
        schema's, or the prompt's turn before) without a prefix of its own."""
        fmt, items = self.encoder.chat_format, self.out.items
        first_text = not any(isinstance(item, TextPiece) for item in items)
        if role == "system":
            if not first_text or any(s.role == "system" for s in self.schema.role_sections.values()):
                raise ChatTemplateError(f"{FOLDED_SYSTEM}: a <system> turn must be the prompt's first text, in a "
                                        "schema without <system>", line=line)
            self.system_turn = len(items)
        elif role == "user" and ((self.system_open and first_text) or self.system_turn == len(items) - 1):
            self.folded_user = len(items)
            return fmt.user_prefix_after("system")
        elif self.system_turn == len(items) - 1:
            raise ChatTemplateError(f"{FOLDED_SYSTEM}: the turn after <system> must be <user>", line=line)
        return fmt.prefixes[role]

    def _bound_section(self, role: str, imports: list[etree._Element]) -> RoleSection:
        sections = set()
        for element in imports:
            if element.tag in ROLE_TAGS:
                raise PromptError(f"<{element.tag}> cannot be nested inside <{role}>", line=element.sourceline)
            module = self._lookup(self.schema.root, element)
            if module.path not in self.section_of:
                raise PromptError(f"<{role}> wraps <{element.tag}/>, which is not inside a schema <{role}> "
                                  f"section; declare the section in the schema", line=element.sourceline)
            sections.add(self.section_of[module.path])
        if len(sections) > 1:
            raise PromptError(f"one <{role}> imports modules from {len(sections)} different schema <{role}> "
                              "sections", line=imports[0].sourceline)
        section = self.schema.role_sections[sections.pop()]
        if section.role != role:
            raise PromptError(f"<{role}> wraps modules of the schema's <{section.role}> section",
                              line=imports[0].sourceline)
        return section

    def _import_top(self, element: etree._Element) -> ImportItem:
        item = ImportItem([], [], element.sourceline)
        self._import(element, self.schema.root, item)
        return item

    def _import(self, element: etree._Element, scope: Module, item: ImportItem) -> None:
        module = self._lookup(scope, element)
        line = element.sourceline
        if module.path in self.out.imported:
            raise DuplicateImportError(f"module {module.path!r} is imported twice (first at line "
                                       f"{self.out.imported[module.path]})", line=line)
        union = self.union_of.get(id(module))
        if union is not None:
            chosen = self.union_choice.get(id(union))
            if chosen is not None:
                raise DuplicateImportError(f"<{element.tag}/> and {chosen!r} are members of one <union>; "
                                           "import at most one", line=line)
            self.union_choice[id(union)] = module.path
        self.out.imported[module.path] = line
        item.module_paths.append(module.path)
        self._arguments(element, module, item)
        for child in iter_content(element):
            if isinstance(child, TextItem):
                raise PromptError(f"text {child.text[:40]!r} inside the import <{element.tag}>; new text "
                                  "goes outside module imports (or into a <param> argument)", line=child.line)
            if child.tag in ROLE_TAGS:
                raise PromptError(f"<{child.tag}> inside the import <{element.tag}>; role sections inside "
                                  "a module are part of the module", line=child.sourceline)
            self._import(child, module, item)
        self._apply_union_defaults(module, item)

    def _lookup(self, scope: Module, element: etree._Element) -> Module:
        module = scope.scope.get(element.tag)
        if module is not None:
            return module
        where = f"module {scope.path!r}" if scope.path else f"schema {self.schema.name!r}"
        deeper = [p for p in self.schema.modules if p.endswith("." + element.tag)]
        hint = f"; it exists nested as {deeper[0]!r}: import it inside its parent" if deeper else ""
        raise UnknownModuleError(f"<{element.tag}> is not a module of {where} (expected one of "
                                 f"{sorted(scope.scope) or 'no modules'}){hint}", line=element.sourceline)

    def _arguments(self, element: etree._Element, module: Module, item: ImportItem) -> None:
        for name, value in element.attrib.items():
            param = module.params.get(name)
            if param is None:
                raise UnknownParamError(f"<{element.tag}> has no parameter {name!r} (expected one of "
                                        f"{sorted(module.params) or 'no parameters'})", line=element.sourceline)
            tokens = self.encoder.encode(value)
            if len(tokens) > param.length:
                raise ArgumentTooLongError(
                    f"argument {name!r} of module {module.path!r} is {len(tokens)} tokens; the limit is "
                    f"{param.length} tokens (<param len>)", line=element.sourceline)
            if tokens:
                source = f"{module.path}.{name}"
                item.arguments.append(NewRun(tokens, param.start, "argument", source, element.sourceline))
                self.out.argument_values[source] = (param.length, value)

    def _apply_union_defaults(self, module: Module, item: ImportItem) -> None:
        for union in (u for u in module.unions if u.default is not None and id(u) not in self.union_choice):
            member = next(m for m in union.members if m.name == union.default)
            self.union_choice[id(union)] = member.path
            self.out.imported[member.path] = union.line
            item.module_paths.append(member.path)
            self._apply_union_defaults(member, item)


def _sections_by_module(schema: Schema) -> dict[str, int]:
    """Module path -> id of the root-level role section that contains it."""
    found: dict[str, int] = {}
    for section in (s for s in schema.role_sections.values() if not s.owner_path):
        stack = list(section.children)
        while stack:
            node = stack.pop()
            if isinstance(node, Module):
                found[node.path] = section.section_id
                stack.extend(node.children)
            elif isinstance(node, Union):
                stack.extend(node.members)
    return found
