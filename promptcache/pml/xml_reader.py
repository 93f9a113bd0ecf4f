"""Hardened XML reading for PML: strict lxml parsing and the whitespace rule for text."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from lxml import etree

from promptcache.pml.errors import PmlLimitError, PmlSecurityError, PmlSyntaxError

_XML_SPACE = "{http://www.w3.org/XML/1998/namespace}space"
# Any DTD can declare entities (billion laughs, XXE); PML never needs one, so it is refused before
# lxml sees the document.
_FORBIDDEN = re.compile(rb"<!DOCTYPE|<!ENTITY|<!ELEMENT|<!ATTLIST", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class TextItem:
    """A run of character data between elements, after the whitespace rule."""

    text: str
    line: int


def parse_xml(text: str | bytes, *, max_bytes: int, max_depth: int, max_elements: int, what: str) -> etree._Element:
    """Parse `text` strictly (no recovery, DTD, entities, network, or processing instructions).
    libxml2 parses in linear time; the element count is checked (in C) before any Python walks the tree.

    Raises PmlLimitError, PmlSecurityError or PmlSyntaxError (with the line) on bad input.
    """
    data = text.encode("utf-8") if isinstance(text, str) else text
    if len(data) > max_bytes:
        raise PmlLimitError(f"{what} is {len(data)} bytes; the limit is {max_bytes} bytes")
    match = _FORBIDDEN.search(data)
    if match:
        line = data.count(b"\n", 0, match.start()) + 1
        raise PmlSecurityError(f"{what} contains a DTD or entity declaration; PML forbids them", line=line)
    parser = etree.XMLParser(
        resolve_entities=False, no_network=True, load_dtd=False, dtd_validation=False,
        recover=False, huge_tree=False, remove_comments=True, remove_pis=False, collect_ids=False,
    )
    try:
        root = etree.fromstring(data, parser)
    except etree.XMLSyntaxError as exc:
        raise PmlSyntaxError(f"{what} is not well-formed XML: {exc.msg}", line=exc.lineno) from None
    num_elements = int(root.xpath("count(//*)"))
    if num_elements > max_elements:
        raise PmlLimitError(f"{what} has {num_elements} elements; the limit is {max_elements}")
    _check_tree(root, max_depth=max_depth, what=what)
    return root


def _check_tree(root: etree._Element, *, max_depth: int, what: str) -> None:
    # Both searches run in libxml2: no Python object per element (a walk here cost more than the parse).
    too_deep = root.xpath("/" + "/".join(["*"] * (max_depth + 1)))  # the elements at depth max_depth + 1
    if too_deep:
        raise PmlLimitError(f"{what} nests deeper than {max_depth} elements", line=too_deep[0].sourceline)
    for node in root.iter(etree.ProcessingInstruction, etree.Entity):
        if isinstance(node, etree._ProcessingInstruction):
            raise PmlSecurityError(f"{what} contains a processing instruction; PML forbids them", line=node.sourceline)
        raise PmlSecurityError(f"{what} contains an entity reference", line=node.sourceline)


def iter_content(element: etree._Element) -> Iterator[TextItem | etree._Element]:
    """Yield the text runs and child elements of `element` in document order (comments are gone)."""
    preserve = _preserves_space(element)
    if element.text:
        item = _text_item(element.text, element.sourceline, preserve)
        if item is not None:
            yield item
    for child in element:
        yield child
        if child.tail:
            item = _text_item(child.tail, child.sourceline, preserve)
            if item is not None:
                yield item


def _preserves_space(element: etree._Element) -> bool:
    node: etree._Element | None = element
    while node is not None:
        value = node.get(_XML_SPACE)
        if value is not None:
            return value == "preserve"
        node = node.getparent()
    return False


def _text_item(raw: str, line: int, preserve: bool) -> TextItem | None:
    text = raw if preserve else normalize_whitespace(raw)
    return TextItem(text, line) if text else None


def normalize_whitespace(raw: str) -> str:
    """Drop layout whitespace: a leading or trailing whitespace run that spans a line break goes,
    and the common indentation of the remaining lines after the first is removed. Spaces that do
    not span a line break are content and stay ("of <param/> days")."""
    # str.strip's whitespace is re's \s; a regex anchored at the end (r"\s*$" with search) retries at
    # every position of a long whitespace run, quadratic in its length.
    leading_end = len(raw) - len(raw.lstrip())
    trailing_start = len(raw.rstrip())
    start = leading_end if "\n" in raw[:leading_end] else 0
    end = trailing_start if "\n" in raw[trailing_start:] else len(raw)
    text = raw[start:end] if start < end else ""
    if "\n" not in text:
        return text
    first, *rest = text.split("\n")
    indents = [len(line) - len(line.lstrip(" \t")) for line in rest if line.strip()]
    cut = min(indents, default=0)
    return "\n".join([first, *(line[cut:] for line in rest)])
