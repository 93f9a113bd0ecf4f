"""Where one decode step goes: engine phases, module kinds and ops at batch 1, 4, 16, in process.

    python -m benchmarks.engine.decode_profile --batches 1 4 16 [--steps 40] \\
        [--out benchmarks/results/decode_profile.jsonl]

The server's own PromptService (default SmolLM2-135M-Instruct, `--dtype auto`, default settings, 2 torch
threads) in this process, no HTTP: `batch` requests of the load benchmark's completion workload (a ~2K-token
document, reused through prefix blocks after one warm request, + a new question), greedy, `ignore_eos`.
Once every sequence decodes, consecutive decode steps are measured three times over, each pass with only
its own probes installed (engine/step_probes.py):
  phases   wall time of schedule / run (forward, lm_head, the rest: step inputs, segments) / postprocess
           (sample, detokenize, the rest) / deliver / store_prefixes, and `between` (the engine loop outside
           its step); CPU time of the engine thread, the event-loop thread and the other (OpenMP) threads
  modules  exclusive wall time per module kind (projections, attention, norms, glue) from forward hooks
  ops      torch.profiler: self CPU time per op, the bf16 extension's calls labelled `kernel:*`; what no op
           covers is Python and dispatch (the profiler's own cost included: it inflates this share)
Event loop and SSE cost are not in this process: `benchmarks/load.py` times streams over HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from benchmarks.engine.step_probes import KernelLabels, ModuleProbe, PhaseProbe
from benchmarks.harness import RESULTS, emit, log
from benchmarks.serving_workloads import build
from promptcache.model_runtime import SamplingParams, confine_to_this_thread, load_model, run_in_passing_thread
from promptcache.model_runtime.engine.request import SeqStatus
from promptcache.server.app import GIL_SWITCH_INTERVAL_S
from promptcache.server.service import PromptService
from promptcache.server.settings import ServerSettings

PASSES = ("warm", "phases", "modules", "ops")


class StepDriver:
    """Replaces `engine._step` (an instance attribute) with one that, on steps where all `batch`
    sequences decode, runs the passes in order, `counts[pass]` steps each; `done` is set after the last."""

    def __init__(self, engine, batch: int, counts: dict[str, int]) -> None:
        self.engine, self.batch, self.counts = engine, batch, counts
        self.phases = PhaseProbe(engine)
        self.model = engine.runner.loaded.model
        self.modules: ModuleProbe | None = None
        self.labels: KernelLabels | None = None
        self.profiler: torch.profiler.profile | None = None
        self.queue = [p for p in PASSES for _ in range(counts[p])]
        self.ops_wall_s: list[float] = []
        self.cpu: dict[str, float] = {}
        self.done = threading.Event()
        self._original = engine._step
        self._main_clock = time.pthread_getcpuclockid(threading.main_thread().ident)
        engine._step = self._step

    def _is_decoding(self) -> bool:
        scheduler = self.engine.scheduler
        return (len(scheduler.running) == self.batch and not scheduler.waiting
                and all(s.status == SeqStatus.DECODE for s in scheduler.running))

    def _step(self) -> None:
        current = self.queue[0] if self.queue and self._is_decoding() else None
        if current == "phases" and self.phases.is_active is False and not self.phases.per_step:
            self.cpu = self._cpu_marks()
        self.phases.is_active = current == "phases"
        if current == "modules" and self.modules is None:
            self.modules = ModuleProbe(self.model)
        if self.modules is not None:
            self.modules.is_active = current == "modules"
        if current == "ops" and self.profiler is None:
            self.modules.remove()
            self.labels = KernelLabels(self.model)
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()
        started = time.perf_counter()
        self.phases.begin_step()
        self._original()
        self.phases.end_step()
        if current == "ops":
            self.ops_wall_s.append(time.perf_counter() - started)
        if current is None:
            return
        self.queue.pop(0)
        if current == "phases" and (not self.queue or self.queue[0] != "phases"):
            end = self._cpu_marks()
            self.cpu = {k: end[k] - self.cpu[k] for k in end}
        if not self.queue:
            self.profiler.__exit__(None, None, None)
            self.labels.remove()
            self.phases.remove()
            del self.engine._step  # the class's method again
            self.done.set()

    def _cpu_marks(self) -> dict[str, float]:
        return {"wall": time.perf_counter(), "process": time.process_time(), "engine": time.thread_time(),
                "main": time.clock_gettime(self._main_clock)}


async def profile_batch(service: PromptService, batch: int, counts: dict[str, int]) -> StepDriver:
    engine, work = service.runtime.engine, build()
    prompt = work.document + "\n\nQuestion {}: {}\nAnswer:"
    async for _ in engine.submit(service.runtime.plan_text(prompt.format(-1, work.questions[0])),
                                 SamplingParams(max_tokens=1, temperature=0)):
        pass  # the document's prefix blocks are stored: every request below reuses them
    driver = StepDriver(engine, batch, counts)
    params = SamplingParams(max_tokens=sum(counts.values()) + 64, temperature=0, ignore_eos=True)
    plan_text = service.runtime.plan_text
    streams = [engine.submit(plan_text(prompt.format(i, work.questions[i % len(work.questions)])), params)
               for i in range(batch)]

    async def consume(stream) -> None:
        async for event in stream:
            if event.report is not None and event.report.error is not None:
                raise RuntimeError(event.report.error)
            if driver.done.is_set():
                return  # leaving the stream aborts the request

    await asyncio.gather(*(consume(s) for s in streams))
    if not driver.done.is_set():
        raise RuntimeError("the requests ended before every pass ran")
    return driver


def report(driver: StepDriver, batch: int, out: Path, torch_threads: int) -> None:
    steps = driver.phases.per_step
    mean = {name: statistics.fmean(s.get(name, 0.0) for s in steps) * 1e3 for name in
            ("step", "between", "schedule", "run", "forward", "lm_head", "postprocess", "sample", "detokenize",
             "deliver", "store_prefixes")}
    wall = mean["step"] + mean["between"]
    rows = [("schedule", mean["schedule"]),
            ("run: model forward (30 layers)", mean["forward"]),
            ("run: lm_head", mean["lm_head"]),
            ("run: step inputs, segments, bookkeeping", mean["run"] - mean["forward"] - mean["lm_head"]),
            ("postprocess: sample", mean["sample"]),
            ("postprocess: detokenize", mean["detokenize"]),
            ("postprocess: events, bookkeeping", mean["postprocess"] - mean["sample"] - mean["detokenize"]),
            ("deliver (call_soon_threadsafe)", mean["deliver"]),
            ("store_prefixes", mean["store_prefixes"]),
            ("rest of _step", mean["step"] - sum(mean[k] for k in ("schedule", "run", "postprocess", "deliver",
                                                                     "store_prefixes"))),
            ("engine loop between steps", mean["between"])]
    cpu = {k: v / len(steps) * 1e3 for k, v in driver.cpu.items()}
    print(f"\n## batch {batch}: {len(steps)} decode steps, {wall:.2f} ms a step "
          f"(median {statistics.median(s['step'] for s in steps) * 1e3:.2f} ms, fastest "
          f"{min(s['step'] for s in steps) * 1e3:.2f} ms), "
          f"{batch / wall * 1e3:.1f} tok/s")
    print(f"CPU a step: engine thread {cpu['engine']:.2f} ms, event-loop thread {cpu['main']:.2f} ms, "
          f"other threads {cpu['process'] - cpu['engine'] - cpu['main']:.2f} ms (wall {cpu['wall']:.2f} ms)")
    _table("phase", [(n, v) for n, v in rows], wall)
    modules = driver.modules
    num_module_steps = driver.counts["modules"]
    module_rows = sorted(((k, v / num_module_steps * 1e3) for k, v in modules.totals.items()), key=lambda kv: -kv[1])
    print(f"(module pass: forward+lm_head {sum(v for _, v in module_rows):.2f} ms a step with hooks on "
          f"{sum(modules.calls.values()) // num_module_steps} module calls a step)")
    _table("module kind (exclusive)", module_rows, sum(v for _, v in module_rows))
    events = driver.profiler.key_averages()
    num_ops_steps = driver.counts["ops"]
    ops_wall = statistics.fmean(driver.ops_wall_s) * 1e3
    op_rows = sorted(((f"{e.key} (x{e.count / num_ops_steps:.0f})", e.self_cpu_time_total / 1e3 / num_ops_steps)
                      for e in events), key=lambda kv: -kv[1])
    num_calls = sum(e.count for e in events if not e.key.startswith("kernel:")) / num_ops_steps
    covered = sum(v for _, v in op_rows)
    print(f"(op pass: {ops_wall:.2f} ms a step under the profiler, {num_calls:.0f} aten calls a step)")
    _table("op (self CPU)", [*op_rows[:14], ("other ops", sum(v for _, v in op_rows[14:])),
                             ("not in any op: Python, dispatch, profiler", ops_wall - covered)], ops_wall)
    emit({"bench": "decode_profile", "batch": batch, "steps": len(steps), "step_ms": round(wall, 3),
          "tok_per_s": round(batch / wall * 1e3, 2), "phases_ms": {n: round(v, 3) for n, v in rows},
          "cpu_ms": {k: round(v, 3) for k, v in cpu.items()},
          "modules_ms": {n: round(v, 3) for n, v in module_rows},
          "ops_ms": {n: round(v, 3) for n, v in op_rows[:30]}, "ops_step_ms": round(ops_wall, 3),
          "aten_calls_per_step": round(num_calls), "torch_threads": torch_threads}, out)


def _table(title: str, rows: list[tuple[str, float]], total: float) -> None:
    print(f"| {title} | ms | % |\n| --- | ---: | ---: |")
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} | {100 * ms / total:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=40, help="decode steps of the phase pass")
    parser.add_argument("--module-steps", type=int, default=20)
    parser.add_argument("--op-steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS / "decode_profile.jsonl")
    args = parser.parse_args()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as the server runs its engine thread
    settings = ServerSettings(preload_examples=False)
    engine_threads = torch.get_num_threads()
    confine_to_this_thread()  # as the server's threads: torch's parallel work is the engine thread's alone
    service = asyncio.run(run_in_passing_thread(lambda: PromptService(settings, load_model(settings.load_config()))))
    log(f"model {service.model_name}, {service.runtime.model.loaded.model.dtype}, "
        f"attention {service.attention.path.value}, "
        f"torch threads {engine_threads}")
    counts = {"warm": 3, "phases": args.steps, "modules": args.module_steps, "ops": args.op_steps}
    if min(counts.values()) < 1:
        parser.error("every pass needs at least one step")
    try:
        for batch in args.batches:
            report(asyncio.run(profile_batch(service, batch, counts)), batch, args.out, engine_threads)
    finally:
        service.close()


if __name__ == "__main__":
    main()
