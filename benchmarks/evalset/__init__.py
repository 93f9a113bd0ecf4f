"""The fidelity evaluation set (tasks, prompts, scoring) and its full-prefill calibration."""

from benchmarks.evalset.tasks import TASKS, EvalItem, EvalSet, build_eval_set, normalize, score

__all__ = ["TASKS", "EvalItem", "EvalSet", "build_eval_set", "normalize", "score"]
