"""A small slice of the fidelity evaluation on the real SmolLM2 (benchmarks/fidelity.py)."""

from __future__ import annotations

from benchmarks.fidelity import MODES, build_cases, evaluate, summarize
from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime


def test_fidelity_slice(smollm2):
    runtime = ModelRuntime(smollm2, build_store(StoreConfig(), device="cpu"))
    cases = build_cases(runtime, docs=4, pick=2, questions=4)
    slice_ = [c for c in cases if c.task == "fact_qa"][:1] + [c for c in cases if c.task == "template"][:1] \
        + [c for c in cases if c.task == "prefix"][:1]
    records = evaluate(runtime, slice_)
    assert len(records) == len(slice_) * len(MODES)
    # Prompts with no optional parts are served exactly: every mode agrees with the full prefill.
    prefix = [r for r in records if r["task"] == "prefix"]
    assert prefix and all(r["exact_plan"] for r in prefix)
    assert all(r["agrees"] and r["kl"] < 1e-6 for r in prefix if r["mode"] in ("default", "full_prefill_layout"))
    # Every mode produced a scored answer for every prompt.
    assert all(r["answer"] for r in records)
    assert all(r["correct"] is not None for r in records if r["task"].startswith("fact_qa"))
    rows = summarize(records)
    assert {(r["task"], r["mode"]) for r in rows} >= {("fact_qa", m) for m in MODES}
