"""Names and ids in requests over the real server: names end where they end (no trailing newline), a token
id is named once in logit_bias, and a schema name never reaches another tenant's registry entry."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from promptcache.clients.pml_builder import check_name
from promptcache.server.tenants import TenantDirectory
from tests.server.test_api import PROMPT, SCHEMA

TEXT = "The quick brown fox jumps over the lazy dog."


def test_names_with_a_trailing_newline_are_refused(live_server):
    """`^name$` matched with re.match accepts "docs\\n" (`$` also matches before a final newline); an XML
    character reference puts that newline in an attribute."""
    server = live_server()
    for pml in (SCHEMA.replace('name="docs"', 'name="docs&#10;"'),
                SCHEMA.replace('name="d1"', 'name="d1&#10;"')):
        reply = httpx.post(server.url + "/v1/schemas", json={"pml": pml})
        assert reply.status_code == 400 and "is invalid" in reply.json()["error"]["message"], reply.text
    assert httpx.get(server.url + "/v1/schemas").json()["data"] == []
    with pytest.raises(ValueError, match="tenant name"):
        TenantDirectory({"sk-a": "alpha\n"})
    with pytest.raises(ValueError, match="invalid PML name"):
        check_name("docs\n")  # the SDK's builders check names alike


def test_a_token_named_twice_in_logit_bias_is_a_400(live_server):
    server = live_server()
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    for bias in ({"5": 10, "05": -10}, {"5": 1, " 5": 1}):
        for create, extra in ((api.completions.create, {"prompt": TEXT}),
                              (api.chat.completions.create, {"messages": [{"role": "user", "content": TEXT}]})):
            with pytest.raises(openai.BadRequestError) as caught:
                create(model="m", max_tokens=2, logit_bias=bias, **extra)
            message = caught.value.body["message"]
            assert "logit_bias" in message and all(repr(key) in message for key in bias), message
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
    native = httpx.post(server.url + "/v1/generate", json={"prompt": PROMPT, "logit_bias": {"7": 1, "007": 1}})
    assert native.status_code == 400 and "'007'" in native.json()["error"]["message"], native.text
    # One key per token still means what it says: "05" is token 5.
    forced = [api.completions.create(model="m", prompt=TEXT, max_tokens=3, temperature=0, logit_bias={key: 100})
              for key in ("5", "05")]
    assert forced[0].choices[0].text == forced[1].choices[0].text


@pytest.fixture
def tenant_server(live_server, tmp_path):
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({"sk-a": "alpha", "sk-b": "beta"}))
    return live_server(api_keys_file=str(keys_file), api_keys=["sk-default"])


def _client(server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_a_qualified_name_never_reaches_another_tenants_schema(tenant_server):
    """Registry names are `<tenant>/<name>` and the default tenant's are bare, so `alpha/docs` spelled the
    registry name of alpha's schema: the default tenant's lookup loaded (and re-adopted) it, a probe that
    took longer when it existed. No schema name contains '/': such a name is looked up nowhere."""
    server = tenant_server
    _client(server, "sk-a").post("/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
    registry = server.app.state.service.registry
    looked_up: list[str] = []
    load = registry.load
    registry.load = lambda name: looked_up.append(name) or load(name)
    try:
        replies = {}
        for key in ("sk-default", "sk-b"):
            for name in ("alpha/docs", "alpha/missing"):
                prompt = PROMPT.replace('schema="docs"', f'schema="{name}"')
                chat = {"model": "m", "schema": name, "max_tokens": 1,
                        "messages": [{"role": "user", "content": "<d1/>Who sleeps?"}]}
                client = _client(server, key)
                replies[key, name] = [client.post("/v1/generate", json={"prompt": prompt, "max_tokens": 1}),
                                      client.post("/v1/prompts/explain", json={"prompt": prompt}),
                                      client.post("/v1/chat/completions", json=chat)]
    finally:
        registry.load = load
    assert looked_up == []
    for answers in replies.values():
        for reply in answers:
            assert reply.status_code == 404 and reply.json()["error"]["type"] == "schema_not_found", reply.text
    for key in ("sk-default", "sk-b"):  # an existing schema answers exactly as a missing one
        existing = [r.json() for r in replies[key, "alpha/docs"]]
        missing = [json.loads(r.text.replace("alpha/missing", "alpha/docs")) for r in replies[key, "alpha/missing"]]
        assert existing == missing
    assert _client(server, "sk-a").post("/v1/generate", json={"prompt": PROMPT, "max_tokens": 1}).status_code == 200
