"""GET /v1/schemas/{name}/fidelity and the upload's `fidelity_report` against a real server: each sample's
per-mode result checked against an independent full prefill (Hugging Face, plain forward) and the
mode's answer from /v1/generate; exact equals full prefill; caching per schema version; tenancy; limits."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from promptcache.model_runtime.baseline import full_prefill_logits
from tests.model_factories import make_test_tokenizer, make_tiny_model

PETS = """<schema name="pets"><system>Answer briefly.</system><user>
<module name="cats">Cats sleep most of the day.<module name="kittens"> Kittens nap a lot.</module></module>
<module name="dogs"> Dogs bark at strangers.</module>
<union><module name="tea"> Tea is brewed hot.</module><module name="coffee"> Coffee is bitter.</module></union>
<module name="trip">Plan a trip of <param name="days" len="3"/> days.</module>
</user></schema>"""
SINGLE = '<schema name="single"><system>Answer briefly.</system><user><module name="cats">Cats nap.</module></user></schema>'  # noqa: E501 (PML text: whitespace matters)
TOP = 20


@pytest.fixture(scope="module")
def oracle_model():
    """The server's tiny model built again from its seed: the same weights, no promptcache code."""
    return make_tiny_model("llama", vocab_size=len(make_test_tokenizer()))


def _wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p = k / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def _coarse_kl(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(p || q) with each token in both top lists its own outcome and everything else one outcome."""
    common = set(p) & set(q)
    rest_p = 1 - sum(math.exp(p[t]) for t in common)
    rest_q = 1 - sum(math.exp(q[t]) for t in common)
    kl = sum(math.exp(p[t]) * (p[t] - q[t]) for t in common)
    return kl + (rest_p * math.log(rest_p / rest_q) if rest_p > 1e-12 else 0.0)


def _upload(server, pml: str, **extra) -> httpx.Response:
    return httpx.post(server.url + "/v1/schemas", json={"pml": pml, **extra}, timeout=300)


def _report(server, name: str, headers: dict | None = None, **query) -> httpx.Response:
    return httpx.get(f"{server.url}/v1/schemas/{name}/fidelity", params=query, headers=headers, timeout=300)


def test_each_sample_matches_a_full_prefill_oracle_and_exact_is_exact(live_server, oracle_model):
    server = live_server()
    _upload(server, PETS).raise_for_status()
    # Layout positions: on this model, fast and balanced then miss the full prefill's first token on some
    # samples and hit it on others, so the comparison below is exercised both ways.
    response = _report(server, "pets", num_samples=12, fidelity_positions="layout")
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["schema"] == "pets" and report["model"] == "tiny-llama" and not report["cached"]
    settings = server.app.state.settings
    assert (report["fidelity_head_tokens"], report["fidelity_positions"], report["fidelity_context"]) == (
        settings.fidelity_head_tokens, "layout", settings.fidelity_context)  # the server's, but the positions asked
    samples = report["samples"]
    assert report["num_samples"] == len(samples) == 12
    assert len({s["prompt"] for s in samples}) == 12  # distinct combinations
    seen = {p for s in samples for p in s["module_paths"]}
    assert {"cats.kittens", "tea", "coffee"} <= seen  # nested modules and each union member get sampled
    service = server.app.state.service
    for sample in samples:
        tokens = service.plan(sample["prompt"]).token_ids()
        assert sample["prompt_tokens"] == len(tokens)
        logprobs = torch.log_softmax(full_prefill_logits(oracle_model, tokens)[-1], dim=-1)
        top = torch.topk(logprobs, TOP)
        reference = dict(zip(top.indices.tolist(), top.values.tolist()))
        for mode in ("exact", "fast", "balanced"):
            answer = httpx.post(server.url + "/v1/generate", json={
                "prompt": sample["prompt"], "max_tokens": 1, "temperature": 0, "fidelity": mode, "logprobs": TOP,
                "fidelity_positions": "layout"}, timeout=120).json()["choices"][0]["logprobs"]
            result = sample["modes"][mode]
            assert result["top1_agrees"] == (answer["token_ids"][0] == int(logprobs.argmax())), (mode, sample)
            mode_top = dict(zip(answer["top_token_ids"][0], answer["top_token_logprobs"][0]))
            assert result["kl"] == pytest.approx(_coarse_kl(reference, mode_top), abs=1e-4)
        assert sample["modes"]["exact"]["top1_agrees"] and sample["modes"]["exact"]["kl"] < 1e-6
    for mode, stats in report["modes"].items():
        agree = sum(s["modes"][mode]["top1_agrees"] for s in samples)
        kls = [s["modes"][mode]["kl"] for s in samples]
        assert stats["num_samples"] == 12 and stats["top1_agreement"] == pytest.approx(agree / 12, abs=1e-4)
        assert stats["agreement_ci95"] == pytest.approx(_wilson(agree, 12), abs=1e-4)
        assert stats["mean_kl"] == pytest.approx(sum(kls) / 12, abs=1e-6) and stats["max_kl"] == pytest.approx(max(kls))
    assert report["modes"]["exact"]["top1_agreement"] == 1.0 and report["modes"]["exact"]["max_kl"] < 1e-6
    assert 0 < report["modes"]["fast"]["top1_agreement"] < 1 and report["modes"]["fast"]["max_kl"] > 1e-3


def test_a_schema_without_optional_parts_is_exact_in_every_mode(live_server):
    server = live_server()
    _upload(server, SINGLE).raise_for_status()
    report = _report(server, "single", num_samples=8).json()
    assert report["num_samples"] == 1  # its only combination: the one module
    [sample] = report["samples"]
    assert sample["module_paths"] == ["cats"] and sample["exact"]
    for stats in report["modes"].values():
        assert stats["top1_agreement"] == 1.0 and stats["max_kl"] < 1e-6


def test_seeded_sampling_cache_and_invalidation(live_server):
    server = live_server()
    created = _upload(server, PETS, fidelity_report={"num_samples": 6})
    assert created.status_code == 201, created.text
    at_upload = created.json()["fidelity_report"]
    assert at_upload["num_samples"] == 6 and not at_upload["cached"]
    again = _report(server, "pets", num_samples=6).json()
    assert again["cached"] and again["samples"] == at_upload["samples"]
    other_question = _report(server, "pets", num_samples=6, question="").json()
    assert not other_question["cached"] and other_question["question"] == ""
    # the seed, not the question, picks the combinations
    assert [s["module_paths"] for s in other_question["samples"]] == [s["module_paths"] for s in at_upload["samples"]]
    assert all("<user>" in s["prompt"] and s["prompt"].endswith("</user><assistant/></prompt>")
               for s in other_question["samples"])
    reseeded = _report(server, "pets", num_samples=6, seed=7).json()
    assert [s["module_paths"] for s in reseeded["samples"]] != [s["module_paths"] for s in at_upload["samples"]]
    single_imports = _report(server, "pets", num_samples=4, max_imports=1).json()["samples"]
    assert all(len([p for p in s["module_paths"] if "." not in p]) == 1 for s in single_imports)  # nested aside
    # A re-upload is another version: its report is computed afresh, over the new modules.
    assert httpx.delete(server.url + "/v1/schemas/pets").status_code == 204
    assert _report(server, "pets").status_code == 404
    _upload(server, PETS.replace("dogs", "birds")).raise_for_status()
    fresh = _report(server, "pets", num_samples=6).json()
    assert not fresh["cached"] and any("birds" in s["module_paths"] for s in fresh["samples"])
    assert not any("dogs" in s["module_paths"] for s in fresh["samples"])
    # A plain upload carries no report; a report that cannot be computed leaves the upload done.
    plain = _upload(server, SINGLE).json()
    assert "fidelity_report" not in plain and "fidelity_report_error" not in plain
    failed = _upload(server, SINGLE.replace("single", "bell"), fidelity_report={"question": "\x07"})
    assert failed.status_code == 201 and "fidelity_report" not in failed.json()
    assert "xml" in failed.json()["fidelity_report_error"].lower()  # BEL is no XML character
    assert httpx.get(server.url + "/v1/schemas/bell").status_code == 200


def test_limits_and_bad_queries_are_4xx(live_server):
    server = live_server()
    _upload(server, SINGLE).raise_for_status()
    over = _report(server, "single", num_samples=65)
    assert over.status_code == 400 and "at most 64" in over.json()["error"]["message"]
    assert _report(server, "single", num_samples=0).status_code == 422
    unknown = _report(server, "single", samples=3)
    assert unknown.status_code == 400 and unknown.json()["error"]["type"] == "unsupported_parameter"
    assert _report(server, "nope").status_code == 404
    assert _report(server, "single", fidelity_positions="sideways").status_code == 422


def test_a_tenant_sees_only_its_own_reports_and_pays_for_them(live_server, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-a": "alpha", "sk-b": "beta", "sk-g": "gamma"},
                                "quotas": {"gamma": {"rate_limit": "10/minute"}}}))
    server = live_server(api_keys_file=str(keys))
    alpha, beta, gamma = ({"Authorization": f"Bearer {k}"} for k in ("sk-a", "sk-b", "sk-g"))
    httpx.post(server.url + "/v1/schemas", json={"pml": PETS}, headers=alpha, timeout=300).raise_for_status()
    assert _report(server, "pets", headers=alpha, num_samples=2).status_code == 200
    hidden = _report(server, "pets", headers=beta, num_samples=2)
    assert hidden.status_code == 404 and hidden.json()["error"]["type"] == "schema_not_found"
    # beta's own schema of that name has its own report (not alpha's cached one)
    httpx.post(server.url + "/v1/schemas", json={"pml": SINGLE.replace("single", "pets")}, headers=beta,
               timeout=300).raise_for_status()
    own = _report(server, "pets", headers=beta, num_samples=2).json()
    assert not own["cached"] and [s["module_paths"] for s in own["samples"]] == [["cats"]]
    # A report costs a full prefill and three modes per sample, counted in the tenant's rate.
    httpx.post(server.url + "/v1/schemas", json={"pml": SINGLE}, headers=gamma, timeout=300).raise_for_status()
    refused = _report(server, "single", headers=gamma, num_samples=3)
    assert refused.status_code == 400 and "10/minute" in refused.json()["error"]["message"]
    assert _report(server, "single", headers=gamma, num_samples=2).status_code == 200  # 8 requests fit
