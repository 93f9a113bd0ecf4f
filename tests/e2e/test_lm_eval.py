"""EleutherAI's lm-evaluation-harness, unchanged, against our server (`local-completions`: token-id
prompts, echo + logprobs for loglikelihood, plain generation) and against its own `hf` backend on the same
model: per-sample loglikelihoods and generations must agree, and so must the scores (within 0.5 points)."""

from __future__ import annotations

from pathlib import Path

import pytest

from promptcache.model_runtime.loading.default_model import default_model_path
from tests.server.conftest import LiveServer, settings_for

DATA = Path(__file__).parent.parent / "lm_eval_tasks"  # 20 small questions, as multiple choice and as generation

TASKS = {
    "promptcache_mc": """output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""",
    "promptcache_gen": """output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["Question:", "\\n\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
""",
}


def _write_tasks(directory: Path) -> None:
    for task, body in TASKS.items():
        data = DATA / ("mc.jsonl" if task.endswith("mc") else "gen.jsonl")
        (directory / f"{task}.yaml").write_text(
            f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n" + body.format())


def _evaluate(model: str, model_args: str, include: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS), batch_size=1,
                                   device="cpu", log_samples=True, task_manager=TaskManager(include_path=str(include)))


def test_lm_eval_scores_through_our_server_equal_its_hf_backend(smollm2, tmp_path):
    _write_tasks(tmp_path)
    path = default_model_path()
    server = LiveServer(settings_for(max_kv_bytes=1 << 30), lambda: smollm2).start()
    try:
        ours = _evaluate("local-completions", f"model={path},base_url={server.url}/v1/completions,tokenizer={path},"
                                              "tokenized_requests=True,num_concurrent=1,max_retries=1", tmp_path)
    finally:
        server.stop()
    reference = _evaluate("hf", f"pretrained={path},dtype=float32", tmp_path)
    for task, metric in (("promptcache_mc", "acc,none"), ("promptcache_gen", "exact_match,none")):
        assert abs(ours["results"][task][metric] - reference["results"][task][metric]) <= 0.005, task
    ours_mc, ref_mc = ours["samples"]["promptcache_mc"], reference["samples"]["promptcache_mc"]
    assert len(ours_mc) == len(ref_mc) == 20
    for a, b in zip(sorted(ours_mc, key=lambda s: s["doc_id"]), sorted(ref_mc, key=lambda s: s["doc_id"])):
        assert [float(r[0][0]) for r in a["resps"]] == pytest.approx([float(r[0][0]) for r in b["resps"]], abs=1e-3)
    ours_gen = sorted(ours["samples"]["promptcache_gen"], key=lambda s: s["doc_id"])
    ref_gen = sorted(reference["samples"]["promptcache_gen"], key=lambda s: s["doc_id"])
    assert [s["resps"] for s in ours_gen] == [s["resps"] for s in ref_gen]
    assert any(s["resps"][0][0].strip() for s in ours_gen)  # the generations compared are not all empty
