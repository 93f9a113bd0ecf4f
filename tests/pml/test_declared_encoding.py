"""No XML declaration talks the parser out of UTF-8: a DTD spelled in UTF-7 (`+ADw-!DOCTYPE`), or a document declared
UTF-16 or UTF-32, is refused before anything is expanded or loaded, and a file that exists answers exactly as one that
does not (no file oracle)."""

from __future__ import annotations

import pytest
from lxml import etree

from promptcache.pml import PmlError, PmlSecurityError
from promptcache.pml.xml_reader import PmlLimits, _parser, parse_xml


def utf7_markup(markup: str) -> str:
    """`markup` with every `<`, `>`, `[`, `]` and `%` spelled as UTF-7 base64 runs, as an attacker would send it."""
    spelled = {"<": "+ADw-", ">": "+AD4-", "[": "+AFs-", "]": "+AF0-", "%": "+ACU-"}
    return "".join(spelled.get(char, char) for char in markup)


def payloads(existing: str, missing: str) -> dict[str, tuple[str, str]]:
    """Each attack, once naming a file that exists and once one that does not."""
    internal = '<!DOCTYPE schema [<!ENTITY n "evil">]>'
    system = '<!DOCTYPE schema SYSTEM "file://{}">'
    parameter = '<!DOCTYPE schema [<!ENTITY % p SYSTEM "file://{}"> %p;]>'
    body = '<schema name="&n;"><module name="m">x</module></schema>'
    cases = {}
    for encoding in ("UTF-7", "utf-7", "UTF-16", "UTF-16LE", "UTF-32", "ISO-8859-1"):
        declaration = f'<?xml version="1.0" encoding="{encoding}"?>\n'
        spell = utf7_markup if encoding.lower() == "utf-7" else (lambda markup: markup)
        cases[f"{encoding}-internal"] = (declaration + spell(internal) + "\n" + body,) * 2
        cases[f"{encoding}-system"] = tuple(declaration + spell(system.format(path)) + "\n" + body
                                            for path in (existing, missing))
        cases[f"{encoding}-parameter"] = tuple(declaration + spell(parameter.format(path)) + "\n" + body
                                               for path in (existing, missing))
    return cases


@pytest.fixture
def files(tmp_path):
    existing = tmp_path / "secret.dtd"
    existing.write_text('<!ENTITY n "leaked">')
    return str(existing), str(tmp_path / "missing.dtd")


def test_declared_encodings_are_refused_alike_for_existing_and_missing_files(pml, files):
    for name, (with_existing, with_missing) in payloads(*files).items():
        messages = []
        for text in (with_existing, with_missing):
            with pytest.raises(PmlSecurityError) as caught:
                pml.schema(text)
            messages.append(str(caught.value))
        assert messages[0] == messages[1].replace(files[1], files[0]), name
        assert "UTF-8" in messages[0] and "leaked" not in messages[0], name


def test_documents_encoded_in_utf16_or_utf32_bytes_are_refused(files):
    limits = PmlLimits()
    for encoding in ("utf-16", "utf-32"):
        text = f'<?xml version="1.0" encoding="{encoding.upper()}"?><!DOCTYPE s SYSTEM "file://{files[0]}"><s/>'
        with pytest.raises(PmlError):  # read as UTF-8 these bytes are no XML: a syntax error, nothing loaded
            parse_xml(text.encode(encoding), limits, max_bytes=1 << 20, what="schema")


def test_utf8_declarations_still_parse(pml):
    for declaration in ('<?xml version="1.0" encoding="UTF-8"?>', "<?xml version='1.0' encoding='utf8'?>",
                        '<?xml version="1.0"?>', "\ufeff<?xml version=\"1.0\" encoding=\"utf-8\"?>"):
        schema = pml.schema(declaration + '\n<schema name="s"><module name="m">caf\u00e9</module></schema>')
        assert schema.name == "s"


def test_the_parser_reads_utf8_and_loads_nothing_whatever_reaches_it(files):
    # Defence in depth behind the scan: handed a DTD directly, the parser refuses to load any URL, with one message.
    messages = []
    for path in files:
        for markup in (f'<!DOCTYPE s SYSTEM "file://{path}"><s/>',
                       f'<!DOCTYPE s [<!ENTITY % p SYSTEM "file://{path}"> %p;]><s/>'):
            with pytest.raises(PmlSecurityError) as caught:
                etree.fromstring(markup.encode(), _parser("schema"))
            messages.append(str(caught.value))
    assert len(set(messages)) == 1 and "external resource" in messages[0]
    utf7 = b'<?xml version="1.0" encoding="UTF-7"?>\n+ADw-!DOCTYPE s+AD4-\n<s/>'
    with pytest.raises(etree.XMLSyntaxError):  # read as UTF-8, "+ADw-" is text before the root: not a DTD
        etree.fromstring(utf7, _parser("schema"))
