"""Hostile XML is refused fast: entity expansion, external entities, processing instructions."""

from __future__ import annotations

import time

import pytest

from promptcache.pml import PmlSecurityError

BILLION_LAUGHS = """<?xml version="1.0"?>
<!DOCTYPE lolz [
 <!ENTITY lol "lol">
 <!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
 <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
 <!ENTITY lol9 "&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;">
]>
<schema name="s"><module name="m">&lol9;</module></schema>"""

XXE = """<?xml version="1.0"?>
<!DOCTYPE foo [<!ENTITY xxe SYSTEM "file:///etc/passwd">]>
<schema name="s"><module name="m">&xxe;</module></schema>"""

XXE_NETWORK = """<!DOCTYPE foo SYSTEM "http://127.0.0.1:9/evil.dtd"><schema name="s"/>"""


@pytest.mark.parametrize("payload", [BILLION_LAUGHS, XXE, XXE_NETWORK])
def test_dtd_payloads_rejected_fast(pml, payload):
    started = time.perf_counter()
    with pytest.raises(PmlSecurityError, match="DTD or entity"):
        pml.schema(payload)
    assert time.perf_counter() - started < 0.5


def test_prompt_payloads_rejected(pml):
    pml.schema('<schema name="s"><module name="m">x</module></schema>')
    with pytest.raises(PmlSecurityError):
        pml.prompt(XXE.replace("<schema name=\"s\">", '<prompt schema="s">').replace("</schema>", "</prompt>"))


def test_processing_instructions_rejected(pml):
    with pytest.raises(PmlSecurityError, match="processing instruction"):
        pml.schema('<schema name="s"><?php echo 1; ?><module name="m">x</module></schema>')
