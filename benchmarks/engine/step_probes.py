"""Timers wrapped around a live Engine from outside: step phases, and module hooks with exclusive times."""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from promptcache.model_runtime.attention import bf16_kernel
from promptcache.model_runtime.detokenizer import Detokenizer
from promptcache.model_runtime.engine import Engine


class PhaseProbe:
    """Wall time of each engine phase per step while `is_active`: schedule, run (forward, lm_head and
    the step's host-side setup), postprocess (sample, detokenize, bookkeeping), deliver, store_prefixes,
    and `between` (the engine loop outside `_step`: inbox, condition variable, waits for the GIL).
    Wraps instance attributes and two class methods; `remove` restores them."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.is_active = False
        self.per_step: list[dict[str, float]] = []
        self._current: dict[str, float] = defaultdict(float)
        self._last_end: float | None = None
        self._undo: list[Callable[[], None]] = []
        scheduler, runner = engine.scheduler, engine.runner
        self._wrap(scheduler, "schedule", "schedule")
        self._wrap(engine.outputs, "postprocess", "postprocess")
        self._wrap(runner, "run", "run")
        self._wrap(engine, "_deliver", "deliver")
        self._wrap(engine, "_store_prefixes", "store_prefixes")
        self._wrap(engine.outputs, "_draw", "sample")  # the step's picks, all rows at once
        self._wrap_class(Detokenizer, "push", "detokenize")
        model = engine.runner.loaded.model
        if runner.stack is not None:  # batch steps of fused models run the layers as plain loops
            for name in ("stack", "decode_stack"):
                self._time_loop(runner, name)
        else:
            self._hook(model.base_model, "forward")
        self._hook(model.get_output_embeddings(), "lm_head")

    def _time_loop(self, runner, name: str) -> None:
        """Count the runner's layer loop `name` (if it has one) as the step's forward."""
        loop = getattr(runner, name)
        if loop is None:
            return

        def timed(*args):
            started = time.perf_counter()
            try:
                return loop(*args)
            finally:
                self._add("forward", time.perf_counter() - started)

        setattr(runner, name, timed)
        self._undo.append(lambda: setattr(runner, name, loop))

    def begin_step(self) -> None:
        now = time.perf_counter()
        self._current = defaultdict(float)
        if self._last_end is not None:
            self._current["between"] = now - self._last_end
        self._started = now

    def end_step(self) -> None:
        now = time.perf_counter()
        self._last_end = now
        if self.is_active:
            self._current["step"] = now - self._started
            self.per_step.append(dict(self._current))

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()

    def _add(self, name: str, seconds: float) -> None:
        self._current[name] += seconds

    def _wrap(self, owner: object, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._add(name, time.perf_counter() - started)

        setattr(owner, attribute, timed)
        self._undo.append(lambda: delattr(owner, attribute))

    def _wrap_class(self, cls: type, attribute: str, name: str) -> None:
        original = getattr(cls, attribute)

        def timed(obj, *args, **kwargs):
            started = time.perf_counter()
            try:
                return original(obj, *args, **kwargs)
            finally:
                self._add(name, time.perf_counter() - started)

        setattr(cls, attribute, timed)
        self._undo.append(lambda: setattr(cls, attribute, original))

    def _hook(self, module: torch.nn.Module, name: str) -> None:
        starts: list[float] = []
        pre = module.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))
        post = module.register_forward_hook(lambda *_: self._add(name, time.perf_counter() - starts.pop()))
        self._undo += [pre.remove, post.remove]


def module_kind(name: str) -> str | None:
    """The breakdown row of a module by its qualified name, or None for modules not timed on their own
    (their time stays with the nearest timed ancestor)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf.endswith("_proj"):
        return f"matmul {leaf}"
    if leaf == "lm_head":
        return "matmul lm_head"
    if leaf.endswith("layernorm") or leaf == "norm":
        return "rmsnorm"
    if leaf == "self_attn":
        return "attention (rope, KV write, attend; projections apart)"
    if leaf == "mlp":
        return "mlp glue (silu*up; projections apart)"
    if leaf.isdigit() and name.endswith(f"layers.{leaf}"):
        return "decoder layer glue (residual adds, Python)"
    if leaf == "embed_tokens":
        return "embedding"
    if leaf == "rotary_emb":
        return "rope tables (cos/sin)"
    return None


class ModuleProbe:
    """Exclusive wall time per module kind (`module_kind`) while `is_active`: each timed module's time
    less that of its timed children, so the rows add up to the forward pass plus the LM head. Hook
    overhead (two Python calls per module) inflates the total: compare with PhaseProbe's `forward`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.is_active = False
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[float]] = []  # [start, children's inclusive seconds]
        self._handles = []
        timed = {name: kind for name, _ in model.named_modules() if (kind := module_kind(name)) is not None}
        timed[_base_name(model)] = "model glue (Python between layers)"
        for name, module in model.named_modules():
            if name in timed:
                self._handles.append(module.register_forward_pre_hook(self._enter))
                self._handles.append(module.register_forward_hook(self._exit_as(timed[name])))

    def _enter(self, *_) -> None:
        self._stack.append([time.perf_counter(), 0.0])

    def _exit_as(self, kind: str):
        def exit_(*_) -> None:
            started, children = self._stack.pop()
            inclusive = time.perf_counter() - started
            if self._stack:
                self._stack[-1][1] += inclusive
            if self.is_active:
                self.totals[kind] += inclusive - children
                self.calls[kind] += 1
        return exit_

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _base_name(model: torch.nn.Module) -> str:
    base = model.base_model
    return next(name for name, module in model.named_modules() if module is base)


class KernelLabels:
    """Makes the bf16 extension's calls (pybind, outside PyTorch's dispatcher, so a profiler sees no op)
    show up in torch.profiler as `kernel:<name>`: the attention kernel and each fused module's ops are
    swapped for labelled wrappers; `remove` puts the originals back."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._undo: list[Callable[[], None]] = []
        kernel = bf16_kernel.loaded()
        if kernel is not None:
            state = bf16_kernel._state  # a benchmark probe: restored by remove()
            originals = dict(state)
            state["kernel"] = _labelled("kernel:flash_bf16", kernel)
            batch_type = state["decode_batch"]
            state["decode_batch"] = lambda *args: _LabelledBatch(batch_type(*args))
            if state.get("int4") is not None:
                state["int4"] = dataclasses.replace(state["int4"], mm=_labelled("kernel:int4_mm", state["int4"].mm))
            self._undo.append(lambda: state.update(originals))
        for module in model.modules():
            ops = getattr(module, "ops", None)
            if isinstance(ops, bf16_kernel.FusedOps):
                module.ops = dataclasses.replace(ops, **{f.name: _labelled(f"kernel:{f.name}", getattr(ops, f.name))
                                                         for f in dataclasses.fields(ops)})
                self._undo.append(lambda module=module, ops=ops: setattr(module, "ops", ops))

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()


class _LabelledBatch:
    """A DecodeBatch whose per-layer calls show as `kernel:decode_batch`."""

    def __init__(self, batch) -> None:
        self.attend = _labelled("kernel:decode_batch", batch.attend)


def _labelled(name: str, fn: Callable) -> Callable:
    def call(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return call
