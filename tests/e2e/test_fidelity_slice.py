"""The fidelity modes at the server's defaults on the real SmolLM2 over HTTP, on look-alike documents (the
kind docs/fidelity.md evaluates): `exact` answers as a plain full prefill does, `fast` and `balanced`
reuse second encodings (made on first use) and report what they recomputed."""

from __future__ import annotations

import httpx

from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime
from promptcache.model_runtime.baseline import full_prefill_greedy
from promptcache.server.settings import ServerSettings
from tests.server.conftest import LiveServer, settings_for

NOTICE = ("Depot access sheet: the {name} depot. Visitors sign in at the front desk and wear a badge at all "
          "times. Safety shoes are required in the loading area. The gate code of the {name} depot is {code}. "
          "Deliveries are accepted on weekdays between seven and four.")
DEPOTS = [("Kalo", "4821"), ("Merta", "1937"), ("Vinsa", "6054"), ("Dalmi", "2718")]
SCHEMA = ('<schema name="depots"><system>Answer the question with a short phrase, using only the documents.'
          "</system><user>" + "".join(f'<module name="d{i}">{NOTICE.format(name=n, code=c)}\n\n</module>'
                                      for i, (n, c) in enumerate(DEPOTS)) + "</user></schema>")
PROMPT = ('<prompt schema="depots"><user><d3/><d0/><d1/>Question: What is the gate code of the Merta depot?'
          "</user><assistant/></prompt>")
GENERATE = 12


def test_modes_at_their_defaults_on_lookalike_documents(smollm2):
    defaults = {name: ServerSettings.model_fields[name].default
                for name in ("fidelity_context", "fidelity_positions", "fidelity_head_tokens")}
    server = LiveServer(settings_for(max_kv_bytes=1 << 30, **defaults), lambda: smollm2).start()
    try:
        httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=600).raise_for_status()
        answers = {mode: httpx.post(server.url + "/v1/generate", timeout=600, json={
            "prompt": PROMPT, "max_tokens": GENERATE, "temperature": 0, "logprobs": 0, "fidelity": mode}).json()
            for mode in ("exact", "fast", "balanced")}
    finally:
        server.stop()
    runtime = ModelRuntime(smollm2, build_store(StoreConfig()))
    runtime.add_schema(runtime.parse_schema(SCHEMA), encode=False)
    tokens = runtime.plan(PROMPT, add_generation_prompt=True).token_ids()  # as the server parses it
    reference = full_prefill_greedy(smollm2.model, tokens, list(range(len(tokens))), GENERATE, smollm2.eos_token_ids)
    exact = answers["exact"]
    assert exact["choices"][0]["logprobs"]["token_ids"][:len(reference)] == reference  # fp32: a full prefill
    assert exact["cache"]["context"] == "schema"  # exact ignores the context
    k = defaults["fidelity_head_tokens"]
    for mode in ("fast", "balanced"):
        cache = answers[mode]["cache"]
        assert cache["fidelity"] == mode and cache["context"] == "predecessor"
        # in layout order: d0 first (its own encoding, in context), d1 right after d0 (its second encoding is
        # in context: nothing to recompute), d3 after a gap (its second encoding, after d2: out of context)
        assert [(m["path"], m["encoded_after"]) for m in cache["modules"]] == [("d0", None), ("d1", "d0"),
                                                                             ("d3", "d2")]
        recomputed = [m["recomputed_tokens"] for m in cache["modules"]]
        assert recomputed == ([0, 0, 0] if mode == "fast" else [0, 0, k])
        assert cache["recomputed_tokens"] == sum(recomputed)
