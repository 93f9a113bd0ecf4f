"""A slice of the fidelity evaluation (benchmarks/fidelity.py) on the real SmolLM2 over HTTP: one prompt
per task in every mode, against the in-process full-prefill reference."""

from __future__ import annotations

import httpx

from benchmarks.fidelity import GENERATE, mode_answers, reference_answers, summarize
from benchmarks.fidelity_tasks import EvalSet, build_eval_set
from tests.server.conftest import LiveServer, settings_for


def test_fidelity_slice(smollm2):
    full = build_eval_set(per_task=3, seed=0)
    items = [full.by_task(task)[0] for task in ("fact_qa", "ruler", "template")]
    eval_set = EvalSet({item.schema_name: full.schemas[item.schema_name] for item in items}, items)
    references = reference_answers(smollm2, eval_set, items)
    server = LiveServer(settings_for(max_kv_bytes=1 << 30), lambda: smollm2).start()
    try:
        for text in eval_set.schemas.values():
            httpx.post(server.url + "/v1/schemas", json={"pml": text}, timeout=600).raise_for_status()
        eos = set(smollm2.eos_token_ids)
        answers = {f"{mode}@{positions}": mode_answers(server.url, items, mode, k, positions, concurrency=3, eos_ids=eos)
                   for mode, k, positions in (("fast", None, "layout"), ("fast", None, "contiguous"),
                                              ("balanced", 8, "contiguous"), ("exact", None, "contiguous"))}
    finally:
        server.stop()
    # exact equals the plain full prefill (greedy tokens; fp32)
    assert [a.token_ids for a in answers["exact@contiguous"]] == [r.token_ids[:GENERATE] for r in references]
    # balanced recomputes a bounded part of the reused module KV, and reports it
    assert all(0 < a.recomputed <= 8 * 6 for a in answers["balanced@contiguous"][:2])
    assert all(a.recomputed == 0 for a in answers["fast@layout"] + answers["fast@contiguous"])
    for mode, mode_list in answers.items():
        row = summarize("slice", mode, items, mode_list, references, [1.0])
        assert row["num_prompts"] == 3 and 0 <= row["accuracy"] <= 100
        assert row["agreement"] == 100.0 or mode != "exact@contiguous"
