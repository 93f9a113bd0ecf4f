"""Deterministic serving (`--deterministic`): the same request and seed give the same tokens and logprobs whatever the
cache state and the batch, because every op whose result for a row could depend on the step's other rows or on how
its keys are split runs through a batch-invariant kernel (csrc/)."""

from promptcache.model_runtime.deterministic.attention import SeqKeys, attention_plan
from promptcache.model_runtime.deterministic.kernels import LIBRARY, prepare, supported, unavailable_reason
from promptcache.model_runtime.deterministic.layers import DeterministicLinear, RotaryTable
from promptcache.model_runtime.deterministic.model_layout import apply, problem, problem_of_settings

__all__ = ["LIBRARY", "DeterministicLinear", "RotaryTable", "SeqKeys", "apply", "attention_plan", "prepare",
           "problem", "problem_of_settings", "supported", "unavailable_reason"]
