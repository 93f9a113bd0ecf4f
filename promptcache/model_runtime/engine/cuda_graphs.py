"""GraphedSteps: uniform steps (all-decode batches, a lone prefill of up to 256 new tokens) padded to a bucket and
run through StaticForward, replayed from a CUDA graph per StepShape (captured lazily, after one eager warm-up that
also compiles the kernels; one memory pool for all). Any other step is None here and the runner runs it eagerly."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from promptcache.model_runtime.attention.shared_prefix import ROWS_PER_PROGRAM
from promptcache.model_runtime.attention.split_keys import num_sms, num_splits
from promptcache.model_runtime.attention.static_attention import StaticTables, uses_kernel
from promptcache.model_runtime.engine.request import SeqStatus
from promptcache.model_runtime.engine.static_step import StaticForward, StepOutput
from promptcache.model_runtime.engine.step_buffers import (
    DECODE_BUCKETS,
    PREFILL_BUCKETS,
    SEGMENT_BUCKETS,
    TRASH_SLOTS,
    SegmentInput,
    SeqInput,
    StepBuffers,
    StepShape,
    bucket,
)
from promptcache.model_runtime.engine.step_plan import ScheduledSeq
from promptcache.model_runtime.kv_pool import KVPool

log = logging.getLogger(__name__)

_T = TypeVar("_T")
GRAPH_DTYPES = frozenset({torch.bfloat16, torch.float16})
# The runner's shared segments: keys, values [L, H_kv, n, D], member sequence indices, their row offsets or None.
Segments = list[tuple[torch.Tensor, torch.Tensor, tuple[int, ...], "tuple[int, ...] | None"]]


@dataclass(frozen=True, slots=True)
class UniformStep:
    """A step StaticForward can run: its real sequences' inputs, its pool, and its shape before segments."""

    seqs: list[SeqInput]
    pool: KVPool
    num_rows: int
    num_seqs: int
    max_query_len: int


def uniform_step(entries: Sequence[ScheduledSeq], max_num_seqs: int) -> UniformStep | None:
    """`entries` as a uniform step — every sequence feeding one token (buckets up to `max_num_seqs`), or one sequence
    feeding up to 256 — all in one pool, none asking for prompt logprobs; else None (the runner's eager path)."""
    if not entries:
        return None
    pool = entries[0].seq.own_pool
    if pool is None or any(e.seq.own_pool is not pool or e.seq.own_slot is None for e in entries):
        return None
    for entry in entries:
        request = entry.seq.request
        if request is not None and request.prompt_logprobs is not None and entry.seq.status == SeqStatus.PREFILL:
            return None  # wants every row's logits: the eager path scores them
    decode = all(e.num_tokens == 1 for e in entries)
    if not decode and len(entries) != 1:
        return None
    # Decode: buckets up to the first that holds max_num_seqs (a batch is never larger).
    largest = bucket(max_num_seqs, DECODE_BUCKETS) or DECODE_BUCKETS[-1]
    size = bucket(len(entries), DECODE_BUCKETS[: DECODE_BUCKETS.index(largest) + 1]) if decode \
        else bucket(entries[0].num_tokens, PREFILL_BUCKETS)
    if size is None:
        return None
    # A prefill is two sequences: itself and one pad sequence of the bucket's remaining rows (possibly none).
    num_rows, num_seqs, max_query_len = (size, size, 1) if decode else (size, 2, size)
    seqs = [SeqInput(tuple(e.seq.pending_ids[: e.num_tokens]), tuple(e.seq.pending_positions[: e.num_tokens]),
                     int(e.seq.own_slot), e.seq.own_length + e.num_tokens)  # type: ignore[arg-type]
            for e in entries]
    return UniformStep(seqs, pool, num_rows, num_seqs, max_query_len)


class GraphedSteps:
    """Static buffers and CUDA graphs per StepShape for one model. `run` is the runner's entry: the step's output, or
    None where the step is not uniform (or no trash range fits in the pool). `use_graphs` False: StaticForward runs
    eagerly (the CPU tests; a GPU with graphs off never builds this)."""

    def __init__(self, model: Any, *, backend: str, max_num_seqs: int, use_graphs: bool) -> None:
        self.forward = StaticForward(model)
        self.device, self.dtype = model.device, model.dtype
        self.backend, self.max_num_seqs, self.use_graphs = backend, max_num_seqs, use_graphs
        self.use_kernel = uses_kernel(backend, self.device, self.dtype)
        self.buffers: dict[StepShape, StepBuffers] = {}
        self.graphs: dict[StepShape, tuple[torch.cuda.CUDAGraph, StepOutput]] = {}
        self.warmed: set[StepShape] = set()
        self._trash: dict[int, int] = {}  # id(pool) -> first of its TRASH_SLOTS reserved slots
        self._memory_pool: Any = None  # torch.cuda.graph_pool_handle(), shared by every graph
        self._stream: torch.cuda.Stream | None = None  # warm-ups and captures run on it
        self._held: Segments = []  # the last step's segments: their KV outlives the replay that reads it

    def run(self, entries: Sequence[ScheduledSeq], segments_of: Callable[[Sequence[ScheduledSeq]], Segments]
            ) -> StepOutput | None:
        """Feed `entries` as one padded static step; the output's rows past len(entries) are pads. Writes each
        sequence's new KV to its pool slots (the caller advances own lengths as after any pass)."""
        step = uniform_step(entries, self.max_num_seqs)
        if step is None:
            return None
        trash = self.trash_slot(step.pool)
        if trash is None:
            return None
        segments = [s for s in segments_of(entries) if s[0].shape[2] > 0]  # an empty segment adds nothing
        num_segments = bucket(len(segments), SEGMENT_BUCKETS)
        if num_segments is None:
            return None
        shape = StepShape(step.num_rows, step.num_seqs, num_segments, self._num_chunks(step, segments, num_segments),
                          step.max_query_len)
        buffers = self.buffers.get(shape)
        if buffers is None:
            buffers = self.buffers[shape] = StepBuffers(shape, self.device)
        inputs = [SegmentInput(k, v, {b: offsets[j] if offsets else 0 for j, b in enumerate(members)})
                  for k, v, members, offsets in segments]
        buffers.fill(step.seqs, inputs, trash)
        self._held = segments
        tables = self.tables(buffers, step.pool, inputs)
        if not self.use_graphs:
            return self.forward(buffers, tables)
        graph = self.graphs.get(shape)
        if graph is None:
            if shape not in self.warmed:  # first sight: run eagerly (compiles Triton, sets up cuBLAS on the stream)
                self.warmed.add(shape)
                return self._on_side_stream(lambda: self.forward(buffers, tables))
            graph = self.graphs[shape] = self._on_side_stream(lambda: self._capture(buffers, tables))
        graph[0].replay()
        return graph[1]

    def trash_slot(self, pool: KVPool) -> int | None:
        """The first of `pool`'s TRASH_SLOTS slots reserved for padded rows (reserved at first use; None: no free
        range that long). Length 0 for every real sequence: no table names them but a pad's."""
        first = self._trash.get(id(pool))
        if first is None:
            first = pool.allocate(TRASH_SLOTS)
            if first is None:
                return None
            self._trash[id(pool)] = first
        return first

    def tables(self, buffers: StepBuffers, pool: KVPool, segments: list[SegmentInput]) -> StaticTables:
        """The attention tables of `buffers` (the reference op also gets the segments' KV tensors)."""
        views, shape = buffers.views, buffers.shape
        held = () if self.use_kernel else tuple(s.keys for s in segments)
        held_values = () if self.use_kernel else tuple(s.values for s in segments)
        return StaticTables(pool.keys, pool.values, views["seq_table"], views["token_table"], views["segment_table"],
                            views["segment_rows"], held, held_values, shape.num_chunks, shape.max_query_len,
                            self.use_kernel)

    def _num_chunks(self, step: UniformStep, segments: Segments, num_segments: int) -> int:
        """Key chunks per segment, as `plan_shared_prefix` picks them (1 on the reference op)."""
        if not self.use_kernel or not segments:
            return 1
        heads, kv_heads = self.forward.num_heads, self.forward.num_kv_heads
        longest = max(s[0].shape[2] for s in segments)
        num_blocks = kv_heads * num_segments * -(-step.num_rows * (heads // kv_heads) // ROWS_PER_PROGRAM)
        return num_splits(num_blocks, longest, num_sms(self.device))

    def _on_side_stream(self, work: Callable[[], _T]) -> _T:
        """Run `work` on the capture stream, ordered after and before the current stream's work (warm-up and
        capture share it, as torch's recipe asks; no host sync, unlike `torch.cuda.graph`'s entry)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            result = work()
        current.wait_stream(self._stream)
        return result

    def _capture(self, buffers: StepBuffers, tables: StaticTables) -> tuple[torch.cuda.CUDAGraph, StepOutput]:
        """Capture StaticForward over `buffers` (their values this step are replayed right after). Thread-local
        capture mode: the store's threads may keep copying KV meanwhile."""
        if self._memory_pool is None:
            self._memory_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._memory_pool, capture_error_mode="thread_local")
        try:
            output = self.forward(buffers, tables)
        finally:
            graph.capture_end()
        log.info("captured a CUDA graph for %s", buffers.shape)
        return graph, output


def graphs_serve(model: Any, *, enabled: bool, backend: str, deterministic: bool) -> bool:
    """Whether uniform steps of `model` are graphed: a CUDA model in bf16/fp16 with graphs on, the shared-prefix
    kernel serving, and a StaticForward for it (fp32, the CPU and other models stay on the eager path)."""
    from promptcache.model_runtime.engine.static_step import static_forward_supported

    return (enabled and not deterministic and model.device.type == "cuda" and model.dtype in GRAPH_DTYPES
            and uses_kernel(backend, model.device, model.dtype) and static_forward_supported(model))
