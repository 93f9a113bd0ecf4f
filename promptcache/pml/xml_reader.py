"""Hardened XML reading for PML: size limits, lxml parsing (strict; bare `<` and `&` in text taken verbatim),
the whitespace rule."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, fields

from lxml import etree

from promptcache.pml.errors import PmlError, PmlLimitError, PmlSecurityError, PmlSyntaxError, SchemaError
from promptcache.pml.text_encoder import MAX_PIECE_CHARS

XML_SPACE = "{http://www.w3.org/XML/1998/namespace}space"
# Any DTD can declare entities (billion laughs, XXE); PML needs none: refused before lxml sees the document. The
# scan reads UTF-8, so the parser is told the document is UTF-8 whatever its declaration says (below): a declared
# UTF-7 would otherwise let libxml2 decode `+ADw-!DOCTYPE` into a DTD the scan never saw.
_FORBIDDEN = re.compile(rb"<!DOCTYPE|<!ENTITY|<!ELEMENT|<!ATTLIST", re.IGNORECASE)
# The XML declaration, which only the document's first bytes may hold (a UTF-8 byte order mark may precede it).
_DECLARED_ENCODING = re.compile(rb"(?:\xef\xbb\xbf)?<\?xml\s[^>]{0,256}?\bencoding\s*=\s*[\"']([^\"']{0,64})[\"']")
_UTF8_NAMES = frozenset({"utf-8", "utf8"})


@dataclass(frozen=True, slots=True)
class PmlLimits:
    """Upper bounds for one PML document; every one is a user-configurable setting."""

    max_schema_bytes: int = 4 * 1024 * 1024
    max_prompt_bytes: int = 1024 * 1024
    max_depth: int = 32
    max_elements: int = 16384  # in one document: every element costs Python work, text does not
    max_modules: int = 4096
    max_scaffolds: int = 1024  # each is encoded jointly on upload, besides the modules' own encodings
    max_param_len: int = 8192
    max_piece_chars: int = MAX_PIECE_CHARS  # characters in one text piece, checked before tokenizing (TextEncoder)
    max_schema_tokens: int = 1_000_000
    # Segment ids in all of a schema's encoding contexts (quadratic in its text pieces): tens of MiB at most.
    max_context_ids: int = 1 << 22

    def __post_init__(self) -> None:
        for name in (limit.name for limit in fields(self)):
            if not isinstance(value := getattr(self, name), int) or value <= 0:
                raise ValueError(f"PmlLimits.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class TextItem:
    """A run of character data between elements, after the whitespace rule."""

    text: str
    line: int


def parse_xml(text: str | bytes, limits: PmlLimits, *, max_bytes: int, what: str) -> etree._Element:
    """Parse `text` strictly (no recovery, DTD, entities, network, or processing instructions), in linear time.
    Raises PmlLimitError, PmlSecurityError or PmlSyntaxError (with the line) on bad input."""
    data = _utf8(text, what) if isinstance(text, str) else text
    if len(data) > max_bytes:
        raise PmlLimitError(f"{what} is {len(data)} bytes; the limit is {max_bytes} bytes")
    declared = _DECLARED_ENCODING.match(data)
    if declared and (encoding := declared[1].decode("ascii", "replace")).lower() not in _UTF8_NAMES:
        raise PmlSecurityError(f"{what} declares encoding {encoding!r}; PML documents are UTF-8: declare "
                               "encoding=\"UTF-8\" or leave the declaration out", line=1)
    if match := _FORBIDDEN.search(data):
        line = data.count(b"\n", 0, match.start()) + 1
        raise PmlSecurityError(f"{what} contains a DTD or entity declaration; PML forbids them", line=line)
    root = _parse_lenient(data, _parser(what), what)
    if root.getroottree().docinfo.doctype:  # cannot pass the scan above; refused again should libxml2 ever differ
        raise PmlSecurityError(f"{what} contains a DTD or entity declaration; PML forbids them", line=1)
    num_elements = int(root.xpath("count(//*)"))  # in C, before any Python walks the tree
    if num_elements > limits.max_elements:
        raise PmlLimitError(f"{what} has {num_elements} elements; the limit is {limits.max_elements}")
    _check_tree(root, max_depth=limits.max_depth, what=what)
    return root


def _parser(what: str) -> etree.XMLParser:
    """A strict parser that reads UTF-8 whatever the document declares and loads nothing from anywhere."""
    parser = etree.XMLParser(encoding="utf-8", resolve_entities=False, no_network=True, load_dtd=False,
                             dtd_validation=False, recover=False, huge_tree=False, remove_comments=True,
                             remove_pis=False, collect_ids=False)
    parser.resolvers.add(_RefuseEveryUrl(what))
    return parser


class _RefuseEveryUrl(etree.Resolver):  # type: ignore[misc]  # lxml ships no types
    """Answers every request for an external resource (a DTD, an entity, a file or a URL) with the same error,
    before anything is opened: whether a file exists never shows in the answer."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def resolve(self, url: str, pubid: str, context: object) -> None:
        raise PmlSecurityError(f"{self.what} refers to an external resource; PML loads none", line=1)


def _utf8(text: str, what: str) -> bytes:
    """`text` as UTF-8; a lone surrogate (JSON's "\\ud800" decodes to one) is a PmlSyntaxError naming its line."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PmlSyntaxError(f"{what} is not valid Unicode text: lone surrogate U+{ord(text[exc.start]):04X}",
                             line=text.count("\n", 0, exc.start) + 1) from None


def _parse_lenient(data: bytes, parser: etree.XMLParser, what: str) -> etree._Element:
    """Parse strictly, then (if that fails) again with bare `<` and `&` escaped (`escape_bare_markup`), so
    code such as `0 <= i < n` is taken verbatim. What still fails is a PmlSyntaxError naming the line (escaping
    inserts no line break), the `<` or `&` nearest before the error, and the fix."""
    try:
        return etree.fromstring(data, parser)
    except etree.XMLSyntaxError as exc:
        error = exc
    escaped = escape_bare_markup(data)
    if escaped != data:
        try:
            return etree.fromstring(escaped, parser)
        except etree.XMLSyntaxError as exc:
            error = exc
    raise PmlSyntaxError(_syntax_message(data, error, what), line=error.lineno) from None


def escape_bare_markup(data: bytes) -> bytes:
    """`data` with every `<` that begins no markup (not followed by a name character, `/`, `!` or `?`)
    written `&lt;`, and every `&` that begins no entity or character reference written `&amp;`, outside
    CDATA sections. Linear: the patterns look ahead to the end of one name at most."""
    pieces: list[bytes] = []
    at = 0
    while (start := data.find(b"<![CDATA[", at)) >= 0:
        end = data.find(b"]]>", start + 9)
        if end < 0:
            break  # unterminated: lxml reports it
        pieces += [_escape_text(data[at:start]), data[start:end + 3]]
        at = end + 3
    pieces.append(_escape_text(data[at:]))
    return b"".join(pieces)


# Each lookahead stops where a name or number ends, and names never contain `&`: linear in the document.
_BARE_AMPERSAND = re.compile(rb"&(?!#[0-9]+;|#x[0-9A-Fa-f]+;|[A-Za-z_:\x80-\xff][A-Za-z0-9_.:\x80-\xff-]*;)")
_BARE_LESS_THAN = re.compile(rb"<(?![A-Za-z_:/!?\x80-\xff])")


_ESCAPE_SLICE_BYTES = 1 << 16


def _escape_text(data: bytes) -> bytes:
    """`data` escaped a slice at a time: one `re.sub` over 2 MiB of `<` keeps the GIL for most of a second, and the
    event loop would wait for it. Each slice ends just before a `<` or `&`, where no lookahead of either pattern
    reaches past (names hold neither), so the slices escape as the whole text does."""
    pieces: list[bytes] = []
    start = 0
    while start < len(data):
        end = min((at for at in (data.find(b"<", start + _ESCAPE_SLICE_BYTES),
                                 data.find(b"&", start + _ESCAPE_SLICE_BYTES)) if at >= 0), default=len(data))
        pieces.append(_BARE_LESS_THAN.sub(b"&lt;", _BARE_AMPERSAND.sub(b"&amp;", data[start:end])))
        start = end
    return b"".join(pieces)


def _syntax_message(data: bytes, error: etree.XMLSyntaxError, what: str) -> str:
    message = f"{what} is not well-formed XML: {error.msg}"
    line, column = error.position if error.position else (error.lineno, 0)
    lines = data.split(b"\n", line)  # at most `line` splits: the lines up to the error's
    if line and len(lines) >= line:
        text = lines[line - 1].decode("utf-8", "replace")
        # lxml's column (in the escaped line) may be past the culprit: name the last `<` or `&` before it.
        culprit = max(text.rfind("<", 0, column - 1), text.rfind("&", 0, column - 1))
        if culprit >= 0:
            message += f" (the {text[culprit]!r} at column {culprit + 1}: {text[culprit:culprit + 24]!r})"
    return (message + ". Write a '<' or '&' that is text as '&lt;' or '&amp;', or wrap the text in "
            "<![CDATA[ ... ]]>; a '<' followed by a letter, '_', ':', '/', '!' or '?' begins markup")


def _check_tree(root: etree._Element, *, max_depth: int, what: str) -> None:
    # Both searches run in libxml2: no Python object per element (a walk here cost more than the parse).
    too_deep = root.xpath("/" + "/".join(["*"] * (max_depth + 1)))  # the elements at depth max_depth + 1
    if too_deep:
        raise PmlLimitError(f"{what} nests deeper than {max_depth} elements", line=too_deep[0].sourceline)
    for node in root.iter(etree.ProcessingInstruction, etree.Entity):
        if isinstance(node, etree._ProcessingInstruction):
            raise PmlSecurityError(f"{what} contains a processing instruction; PML forbids them", line=node.sourceline)
        raise PmlSecurityError(f"{what} contains an entity reference", line=node.sourceline)


def check_attributes(element: etree._Element, allowed: set[str], error: type[PmlError] = SchemaError) -> None:
    """Raise `error` naming the first attribute of `element` not in `allowed`."""
    for attribute in element.attrib:
        if attribute not in allowed:
            expected = ", ".join(sorted(a for a in allowed if not a.startswith("{"))) or "none"
            raise error(f"<{element.tag}> has unknown attribute {attribute!r}; expected: {expected}",
                        line=element.sourceline)


def iter_content(element: etree._Element) -> Iterator[TextItem | etree._Element]:
    """Yield the text runs and child elements of `element` in document order (comments are gone)."""
    preserve = _preserves_space(element)
    yield from _text_item(element.text, element.sourceline, preserve)
    for child in element:
        yield child
        yield from _text_item(child.tail, child.sourceline, preserve)


def _preserves_space(element: etree._Element) -> bool:
    for node in (element, *element.iterancestors()):
        if (value := node.get(XML_SPACE)) is not None:
            return bool(value == "preserve")
    return False


def _text_item(raw: str | None, line: int, preserve: bool) -> tuple[TextItem, ...]:
    text = raw if preserve or not raw else normalize_whitespace(raw)
    return (TextItem(text, line),) if text else ()


def normalize_whitespace(raw: str) -> str:
    """Drop layout whitespace: a leading or trailing whitespace run that spans a line break goes, and the
    lines' common indentation (the first line's only when the dropped run ended it). Spaces that do not span
    a line break are content and stay ("of <param/> days")."""
    # str.strip, not a regex: r"\s*$" with search is quadratic in the length of a whitespace run.
    leading_end = len(raw) - len(raw.lstrip())
    trailing_start = len(raw.rstrip())
    start = leading_end if "\n" in raw[:leading_end] else 0
    end = trailing_start if "\n" in raw[trailing_start:] else len(raw)
    text = raw[start:end] if start < end else ""
    if "\n" not in text:
        return text
    first, *rest = text.split("\n")
    indents = [len(line) - len(line.lstrip(" \t")) for line in rest if line.strip()]
    if start:  # the first line's indentation ended the dropped run: it counts (`class A:` / `    def f` stays nested)
        indents.append(start - raw.rfind("\n", 0, start) - 1)
    cut = min(indents, default=0)
    return "\n".join([first, *(line[cut:] for line in rest)])
