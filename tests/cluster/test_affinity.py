"""Affinity keys read from HTTP requests: what must share a key, what must not (pure, no Ray)."""

from __future__ import annotations

import json
import time

import pytest

from promptcache.cluster import AffinityConfig, ClusterConfigError, ForwardedRequest, affinity_key
from promptcache.server.tenants import TenantDirectory

TENANTS = TenantDirectory({"sk-a": "alpha", "sk-b": "beta"})


def _request(path: str, body: dict | bytes, key: str | None = "sk-a", method: str = "POST") -> ForwardedRequest:
    headers = ((b"authorization", f"Bearer {key}".encode()),) if key else ()
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return ForwardedRequest(method, path, headers=headers, body=raw)


def _key(path: str, body: dict | bytes, key: str | None = "sk-a", **config):
    return affinity_key(_request(path, body, key), TENANTS, AffinityConfig(**config))


def _pml(modules: str, question: str = "Q?", schema: str = "kb") -> dict:
    return {"prompt": f'<prompt schema="{schema}"><user>{modules}{question}</user><assistant/></prompt>'}


def test_pml_prompts_share_a_key_by_tenant_schema_and_module_set():
    base = _key("/v1/generate", _pml("<a/><b/>"))
    assert base.kind == "pml"
    assert _key("/v1/generate", _pml("<b/><a/>", "Another question entirely")) == base  # set, not order
    assert _key("/v1/generate", _pml('<a/><b x="3"/>')) == base  # arguments are computed per request
    assert _key("/v1/prompts/explain", _pml("<a/><b/>")) == base  # explain sees where generate runs
    assert _key("/v1/completions", {"model": "m", **_pml("<a/><b/>")}) == base
    assert _key("/v1/generate", _pml("<a/>")) != base
    assert _key("/v1/generate", _pml("<a/><b/>", schema="other")) != base
    assert _key("/v1/generate", _pml("<a/><b/>"), key="sk-b") != base  # the tenant is part of it


def test_schema_granularity_keys_every_prompt_of_a_schema_alike():
    base = _key("/v1/generate", _pml("<a/><b/>"), pml_key="schema")
    assert _key("/v1/generate", _pml("<c/>", "Other"), pml_key="schema") == base  # any modules
    chat = {"model": "m", "schema": "kb", "messages": [{"role": "user", "content": "<d/>Q?"}]}
    assert _key("/v1/chat/completions", chat, pml_key="schema") == base
    assert _key("/v1/generate", _pml("<a/><b/>", schema="other"), pml_key="schema") != base
    assert _key("/v1/generate", _pml("<a/><b/>"), key="sk-b", pml_key="schema") != base
    assert _key("/v1/generate", _pml("<a/><b/>")) != base  # the default covers the modules too


def test_nested_imports_and_role_tags():
    nested = _key("/v1/generate", {"prompt": '<prompt schema="t"><user><trip><paris/></trip>Go</user></prompt>'})
    flat = _key("/v1/generate", {"prompt": "<prompt schema='t'><system>S</system><trip/><paris/></prompt>"})
    assert nested == flat  # role tags are not modules; quotes either way


def test_chat_with_a_schema_is_keyed_like_a_pml_prompt_of_its_imports():
    chat = {"model": "m", "schema": "kb", "messages": [{"role": "user", "content": "<b/><a/>Q?"}]}
    assert _key("/v1/chat/completions", chat) == _key("/v1/generate", _pml("<a/><b/>"))


def test_plain_completions_share_a_key_by_their_first_characters_and_salt():
    text = "You are a helpful assistant. " * 20
    base = _key("/v1/completions", {"prompt": text + "First question?"})
    assert base.kind == "prefix"
    assert _key("/v1/completions", {"prompt": text + "Second?"}) == base
    assert _key("/v1/completions", {"prompt": [text + "Batched"]}) == base
    assert _key("/v1/completions", {"prompt": text, "cache_salt": "s1"}) != base
    assert _key("/v1/completions", {"prompt": text}, key="sk-b") != base
    assert _key("/v1/completions", {"prompt": "Short and different"}) != base
    ids = _key("/v1/completions", {"prompt": list(range(100))})
    assert ids == _key("/v1/completions", {"prompt": [*range(64), 7, 7, 7]})  # first prefix_chars // 4 ids
    assert _key("/v1/completions", {"prompt": [list(range(100))]}) == ids


def test_every_turn_of_a_chat_keeps_the_first_turns_key():
    system = {"role": "system", "content": "Be brief."}
    first = [system, {"role": "user", "content": "Plan a trip to Paris."}]
    later = [*first, {"role": "assistant", "content": "Day 1: ..."}, {"role": "user", "content": "And day 2?"}]
    other = [system, {"role": "user", "content": "Plan a trip to Rome."}]
    key = _key("/v1/chat/completions", {"model": "m", "messages": first})
    assert key.kind == "prefix"
    assert _key("/v1/chat/completions", {"model": "m", "messages": later}) == key
    assert _key("/v1/chat/completions", {"model": "m", "messages": other}) != key
    parts = [{"role": "user", "content": [{"type": "text", "text": "Plan a trip to Paris."}]}]
    assert _key("/v1/chat/completions", {"model": "m", "messages": [system, *parts]}) == key


def test_the_schema_attribute_is_read_from_the_prompt_start_tag_alone():
    base = _key("/v1/generate", _pml("<a/>"))
    for start_tag in ('<prompt xml:space="preserve" schema=\'kb\'>', '<prompt\n  schema = "kb"  >'):
        assert _key("/v1/generate", {"prompt": f"{start_tag}<user><a/>Q?</user><assistant/></prompt>"}) == base
    other = {"prompt": '<prompts schema="x"/><prompt schema="kb"><a/></prompt>'}  # <prompts> is another tag
    assert _key("/v1/generate", other, pml_key="schema") == _key("/v1/generate", _pml("<a/>"), pml_key="schema")
    assert _key("/v1/generate", {"prompt": '<prompt lang="en"><a/></prompt>'}) is None  # no schema: no key


SIZE = 2 << 20


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/generate", {"prompt": "<prompt " * (SIZE // 8)}),
    ("/v1/completions", {"prompt": '<prompt schema="' * (SIZE // 16)}),
    ("/v1/schemas", {"pml": "<schema " * (SIZE // 8)}),
    ("/v1/schemas", {"pml": "<schema name='kb' " + "a='1' " * (SIZE // 6)}),
    ("/v1/generate", {"prompt": '<prompt schema="kb">' + "<a" * (SIZE // 2)}),
    ("/v1/chat/completions", {"schema": "kb", "messages": [{"role": "user", "content": "<a" * (SIZE // 2)}]}),
], ids=["prompt-openings", "unclosed-quotes", "schema-openings", "many-attributes", "tag-openings", "chat"])
def test_adversarial_bodies_are_keyed_in_linear_time(path, body):
    """The router keys every request on the gateway's event loop, so a slow key stalls routing for every
    client. The old patterns (r"<prompt\b[^>]*?\bschema=...", r"<schema\b[^>]*?\bname=...") rescanned the
    rest of the text from each opening without a `>`: 0.5 s at 16 KiB, 2.1 s at 32 KiB, 7 s at 64 KiB
    (x4 per doubling); prompts were scanned to 256 KiB (minutes), schema uploads whole (2 MiB: hours). The
    openings cases were those; the others aim at this scanner's own loops (quotes, attributes, tags)."""
    request = _request(path, body)
    started = time.perf_counter()
    affinity_key(request, TENANTS)
    assert time.perf_counter() - started < 1


def test_only_the_bodys_prefix_is_read():
    """Keys come from the first `max_body_bytes` of a body: what follows is never decoded (here it is not even
    UTF-8), and a field named after them is absent (the request is routed by load)."""
    prompt = '<prompt schema="kb"><user><a/>' + "word " * (SIZE // 5) + "Q?</user><assistant/></prompt>"
    whole = json.dumps({"prompt": prompt}).encode()
    assert _key("/v1/generate", whole) == _key("/v1/generate", _pml("<a/>"))  # the modules within the prefix
    assert _key("/v1/generate", whole[:100_000] + b"\xff" * SIZE) == _key("/v1/generate", _pml("<a/>"))
    assert _key("/v1/generate", whole, max_body_bytes=20) is None  # the schema attribute is past the prefix
    late = json.dumps({"model": "m", "padding": "x" * 70_000, **_pml("<a/>")}).encode()
    assert _key("/v1/generate", late) is None
    assert _key("/v1/generate", late, max_body_bytes=80_000) == _key("/v1/generate", _pml("<a/>"))
    chat = {"model": "m", "messages": [{"role": "user", "content": "<a/>" + "x" * 70_000}], "schema": "kb"}
    assert _key("/v1/chat/completions", chat).kind == "prefix"  # its schema is past the prefix: plain chat
    assert _key("/v1/chat/completions", chat, max_body_bytes=80_000).kind == "pml"


def test_schema_uploads_are_keyed_by_tenant_and_name():
    upload = _key("/v1/schemas", {"pml": '<schema name="kb"><module name="a">A</module></schema>'})
    assert upload.kind == "schema"
    assert _key("/v1/schemas", {"pml": '<schema name="kb"><module name="b">B</module></schema>'}) == upload
    assert _key("/v1/schemas", {"pml": '<schema name="kb"/>'}, key="sk-b") != upload


@pytest.mark.parametrize(("path", "body", "key", "method"), [
    ("/v1/generate", _pml("<a/>"), None, "POST"),  # no API key: the replica answers 401
    ("/v1/generate", _pml("<a/>"), "sk-wrong", "POST"),
    ("/v1/generate", b"{not json", "sk-a", "POST"),
    ("/v1/generate", {"prompt": "no pml here"}, "sk-a", "POST"),
    ("/v1/generate", {"prompt": 42}, "sk-a", "POST"),
    ("/v1/schemas", {}, "sk-a", "GET"),
    ("/v1/schemas/kb", {}, "sk-a", "DELETE"),
    ("/tokenize", {"prompt": "text"}, "sk-a", "POST"),
    ("/v1/chat/completions", {"messages": "nope"}, "sk-a", "POST"),
])
def test_requests_without_a_key(path, body, key, method):
    assert affinity_key(_request(path, body, key, method), TENANTS) is None


def test_open_server_keys_everyone_as_the_default_tenant():
    open_server = TenantDirectory({})
    request = _request("/v1/generate", _pml("<a/>"), key=None)
    assert affinity_key(request, open_server) == affinity_key(_request("/v1/generate", _pml("<a/>"), "x"), open_server)


def test_config_is_validated():
    with pytest.raises(ClusterConfigError, match="prefix_chars"):
        AffinityConfig(prefix_chars=0)
    with pytest.raises(ClusterConfigError, match="pml_key"):
        AffinityConfig(pml_key="tokens")
    with pytest.raises(ClusterConfigError, match="max_body_bytes"):
        AffinityConfig(max_body_bytes=0)
