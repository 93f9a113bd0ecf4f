"""ModelRunner: one packed forward pass for a step's batch and module-encoding chunk (`run`), attending shared
KV blocks concatenated once per group (AssembledGroups), kept across steps and requests."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from promptcache.model_runtime.attention import bf16_kernel
from promptcache.model_runtime.attention.decode_batch import kernel_takes
from promptcache.model_runtime.attention.sliding_window import WindowedPass
from promptcache.model_runtime.attention.step_indices import to_device
from promptcache.model_runtime.deterministic import SeqKeys, attention_plan
from promptcache.model_runtime.engine.cuda_graphs import GraphedSteps, graphs_serve
from promptcache.model_runtime.engine.kv_groups import AssembledGroups
from promptcache.model_runtime.engine.prefix import KVView
from promptcache.model_runtime.engine.request import Request, SeqStatus
from promptcache.model_runtime.engine.step_plan import ScheduledSeq, StepPlan
from promptcache.model_runtime.loading.fused_layers import decode_stack_forward, fused_stack_forward
from promptcache.model_runtime.loading.loader import LoadedModel
from promptcache.model_runtime.packed_attention import BatchCache, BatchContext, active_batch, cache_argument, install
from promptcache.model_runtime.sampling import TokenLogprobs, batch_logprobs

logger = logging.getLogger(__name__)

_LOGPROB_ROWS = 256  # prompt rows scored per lm_head call: bounds the [rows, vocab] logits in memory

PromptLogprobs = tuple[TokenLogprobs, ...] | None  # of a prefill chunk's prompt tokens, when its request asks


@dataclass(frozen=True, slots=True)
class RunOutput:
    """A step pass's output; `ran`: the entries that ran, all unless a request broke the model alone (`failures`)."""

    ran: tuple[ScheduledSeq, ...] = ()
    logits: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [len(ran), vocab] float32
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
    failures: tuple[tuple[Request, BaseException], ...] = ()
    encoding_s: float | None = None  # the encoding chunk's compute time (None: none ran, or it failed)
    encoding_error: BaseException | None = None
    step_ms: float = 0.0
    # [len(ran)] int64 on the pass's device: each row's argmax, given where the pass computed it (a graphed step) and
    # every row takes only that (`Sampler.takes_argmax`); `logits` is then the graph's output, valid until its next step
    greedy_ids: torch.Tensor | None = None


class ModelRunner:
    """Runs batch steps; shared blocks are grouped by the sequences using them (AssembledGroups)."""

    def __init__(self, loaded: LoadedModel, *, backend: str = "auto", max_assembled_bytes: int = 128 << 20,
                 cuda_graphs: bool = True, max_num_seqs: int = 64, reserve_assembled: bool = False) -> None:
        self.loaded = loaded
        self.backend = backend
        self.groups = AssembledGroups(max_assembled_bytes, loaded.key_shifter)
        if reserve_assembled and loaded.model.device.type == "cpu":  # a GPU's allocator hands out backed memory
            self.groups.reserve(loaded.model.dtype, loaded.model.device)
        install(loaded.model)
        self.stack = fused_stack_forward(loaded.model.base_model)  # None: the HF forward
        # None: `stack` for decodes too (always in deterministic serving: its attention is the deterministic plan's)
        self.decode_stack = None if loaded.deterministic else decode_stack_forward(loaded.model.base_model)
        # Uniform steps (all-decode, a lone prefill <= 256 tokens) replayed from CUDA graphs (engine/cuda_graphs.py).
        self.graphs = GraphedSteps(loaded.model, backend=backend, max_num_seqs=max_num_seqs, use_graphs=True) \
            if graphs_serve(loaded.model, enabled=cuda_graphs, backend=backend, deterministic=loaded.deterministic) \
            else None
        if backend == "auto" and loaded.model.dtype == torch.bfloat16 and loaded.model.device.type == "cpu":
            bf16_kernel.prepare()  # built here, at startup, never inside a request

    def run(self, plan: StepPlan) -> RunOutput:
        """One forward pass for the batch and the encoding chunk. If it fails, each runs alone, so a request that breaks
        the model fails by itself (own lengths advance only after a successful pass)."""
        if not plan.has_forward:
            return RunOutput()
        started = time.perf_counter()
        entries = [*plan.batch, plan.encoding] if plan.encoding is not None else list(plan.batch)
        try:
            logits, greedy_ids, found = self._forward(entries)
        except Exception:
            logger.warning("a batch step failed; running its %d sequences one by one", len(plan.batch), exc_info=True)
            return self._one_by_one(plan, started)
        elapsed = time.perf_counter() - started
        n = len(plan.batch)
        return RunOutput(plan.batch, logits[:n], tuple(found[:n]), greedy_ids=None if greedy_ids is None
                         else greedy_ids[:n], encoding_s=elapsed if plan.encoding is not None else None,
                         step_ms=elapsed * 1e3)

    def _one_by_one(self, plan: StepPlan, started: float) -> RunOutput:
        encoding_s, encoding_error = None, None
        if plan.encoding is not None:
            began = time.perf_counter()
            try:
                self.forward([plan.encoding])
            except Exception as exc:
                logger.exception("module encoding failed")
                encoding_error = exc
            else:
                encoding_s = time.perf_counter() - began
        done: list[tuple[str, ScheduledSeq, torch.Tensor, PromptLogprobs]] = []
        failed: dict[str, tuple[Request, BaseException]] = {}
        for entry in plan.batch:
            request = entry.seq.owner  # a module encoding is never in the batch
            if request.request_id in failed:
                continue
            try:
                logits, found = self.forward([entry])
            except Exception as exc:
                failed[request.request_id] = (request, exc)
                continue
            done.append((request.request_id, entry, logits[0], found[0]))
        done = [item for item in done if item[0] not in failed]  # a request fails whole
        logits = torch.stack([r for _, _, r, _ in done]) if done else torch.empty(0)  # [len(done), vocab]
        return RunOutput(tuple(e for _, e, _, _ in done), logits, tuple(f for *_, f in done), tuple(failed.values()),
                         encoding_s, encoding_error, (time.perf_counter() - started) * 1e3)

    @torch.inference_mode()
    def forward(self, entries: Seq[ScheduledSeq]) -> tuple[torch.Tensor, list[PromptLogprobs]]:
        """Feed each entry's next `num_tokens` pending tokens, writing their KV at its `own_length` on; returns the
        float32 logits [num_entries, vocab] of each one's last token and each one's prompt logprobs."""
        logits, _, found = self._forward(entries, argmax_only=False)
        return logits, found

    @torch.inference_mode()
    def _forward(self, entries: Seq[ScheduledSeq], *, argmax_only: bool | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, list[PromptLogprobs]]:
        """`forward`, and each entry's argmax [num_entries] where a graphed step computed it and every entry takes
        only that (RunOutput.greedy_ids; `argmax_only` None: decided from the entries)."""
        deterministic = self.loaded.deterministic
        window, segments = None, None
        if self.loaded.has_windows:
            segment_positions: list[torch.Tensor] = []
            segments = [] if deterministic else self._segments(entries, segment_positions)
            window = self._window_pass(entries, segments, segment_positions)
        # Graphs and the decode kernel attend without windows: a pass some window cuts runs eagerly, through `window`.
        cut = window is not None and window.cuts_any()
        if self.graphs is not None and not cut:
            if argmax_only is None:
                argmax_only = all(_takes_argmax(e) for e in entries)
            graphed = self._graphed(entries, segments, argmax_only=argmax_only)
            if graphed is not None:
                return *graphed, [None] * len(entries)  # uniform steps never carry prompt logprobs
        model, device = self.loaded.model, self.loaded.model.device
        seqs = [e.seq for e in entries]
        query_lens = [e.num_tokens for e in entries]
        # Step inputs are built on the host and copied without blocking it (pinned, on a GPU).
        input_ids = to_device(torch.tensor([[t for s, n in zip(seqs, query_lens) for t in s.pending_ids[:n]]],
                                           dtype=torch.long), device)  # [1, Q]
        positions = to_device(torch.tensor([[p for s, n in zip(seqs, query_lens) for p in s.pending_positions[:n]]],
                                           dtype=torch.long), device)  # [1, Q]
        # Sequences whose own KV lives in one pool get their new KV written with one index_copy_ per layer.
        pool = next((s.own_pool for s in seqs if s.own_pool is not None), None)
        buffers = [s.own_buffers() for s in seqs]
        if segments is None:
            segments = [] if deterministic else self._segments(entries)
        context = BatchContext(
            query_lens=query_lens, own_keys=[k for k, _ in buffers], own_values=[v for _, v in buffers],
            own_starts=[s.own_length for s in seqs], segments=segments, backend=self.backend, pool=pool,
            own_slots=[s.own_slot if pool is not None and s.own_pool is pool else None for s in seqs],
            deterministic=attention_plan(self._sequence_keys(entries)) if deterministic else None,
            window=window)
        cache = BatchCache(context, self.loaded.num_layers)
        with active_batch(context):
            if self.decode_stack is not None and not cut and kernel_takes(model.dtype, device, self.loaded.head_dim,
                                                                          query_lens, self.backend):
                hidden = self.decode_stack(input_ids, positions, context)  # [1, Q, hidden]
            elif self.stack is not None:
                hidden = self.stack(input_ids, positions, cache)  # [1, Q, hidden]
            else:
                hidden = model.base_model(input_ids=input_ids, position_ids=positions, use_cache=True,
                                          **cache_argument(model.base_model, cache)).last_hidden_state
        last_rows = to_device(torch.tensor(query_lens).cumsum(0) - 1, device)  # [num_seqs]
        logits = model.get_output_embeddings()(hidden[0, last_rows]).float()  # [num_seqs, vocab]
        return logits, None, self._prompt_logprobs(entries, hidden[0])

    def _graphed(self, entries: Seq[ScheduledSeq], segments: list | None, *, argmax_only: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The last-token logits [num_entries, vocab] of a uniform step replayed from a graph, or None for the eager
        path. `argmax_only`: every entry takes the graph's argmax, returned too ([num_entries], a copy: the next replay
        overwrites the outputs), the logits left where they are (no [B, V] copy); else the logits are a copy. A graph
        that fails turns graphs off, logged, once. `segments`: the step's, when already made."""
        assert self.graphs is not None
        try:
            output = self.graphs.run(entries, self._segments if segments is None else lambda _: segments)
        except Exception:
            logger.exception("a graphed step failed; CUDA graphs are off for this runner")
            self.graphs = None
            return None
        if output is None:
            return None
        n = len(entries)
        if argmax_only:
            return output.logits[:n], output.greedy_ids[:n].clone()
        return output.logits[:n].clone(), None

    def _prompt_logprobs(self, entries: Seq[ScheduledSeq], hidden: torch.Tensor) -> list[PromptLogprobs]:
        """Of prefilling sequences whose request wants them: each fed row [Q, hidden_size] scores the next token."""
        found: list[PromptLogprobs] = []
        start = 0
        for entry in entries:
            seq, n = entry.seq, entry.num_tokens
            request = seq.request
            if request is None or request.prompt_logprobs is None or seq.status != SeqStatus.PREFILL:
                found.append(None)
                start += n
                continue
            following = seq.pending_ids[1: n + 1]  # the prompt token each row predicts
            num_top = request.params.prompt_logprobs or 0
            rows: list[TokenLogprobs] = []
            for first in range(0, len(following), _LOGPROB_ROWS):  # bounded [rows, vocab] at a time
                chunk = following[first: first + _LOGPROB_ROWS]
                scores = self.loaded.model.get_output_embeddings()(
                    hidden[start + first: start + first + len(chunk)]).float()  # [rows, vocab]
                rows += batch_logprobs(scores, chunk, num_top)  # one copy back per chunk
            found.append(tuple(rows))
            start += n
        return found

    def _sequence_keys(self, entries: Seq[ScheduledSeq]) -> list[SeqKeys]:
        """Deterministic serving: each entry's logical key sequence, its shared KV in its own order (modules, prefix
        blocks, a fork's prompt) then its own KV; the same keys in the same order cold, warm, alone or batched."""
        found: list[SeqKeys] = []
        for entry in entries:
            seq = entry.seq
            shared = []
            for kv in seq.shared:  # row offsets as in `_segments`; a view's shifted keys made once, kept by `groups`
                keys, values = self.groups.get((kv.view,), {kv.view: kv.block})
                first = max(0, kv.visible_from - seq.prefill_done) if seq.status == SeqStatus.PREFILL else 0
                shared.append((keys, values, first))
            own_keys, own_values = seq.own_buffers()
            found.append((shared, own_keys, own_values, seq.own_length + entry.num_tokens, entry.num_tokens))
        self.groups.trim()
        return found

    def _window_pass(self, entries: Seq[ScheduledSeq], segments: list, positions: list[torch.Tensor]) -> WindowedPass:
        """The positions of a pass over a model with sliding-window layers: its queries', each sequence's own KV's (its
        earlier tokens, then this pass's), and each segment's (`positions`; deterministic serving: each sequence's
        shared KV in its own order, as `_sequence_keys` lists it)."""
        fed = [e.seq.pending_positions[: e.num_tokens] for e in entries]
        own = [e.seq.own_positions + p for e, p in zip(entries, fed)]
        assert all(len(p) == e.seq.own_length + e.num_tokens for e, p in zip(entries, own)), "own KV positions"
        if self.loaded.deterministic:  # the step has no shared segments: each sequence's shared KV is one
            segments, positions = [], []
            for index, (entry, keys) in enumerate(zip(entries, self._sequence_keys(entries))):
                for kv, (shared_keys, shared_values, first) in zip(entry.seq.shared, keys[0]):
                    segments.append((shared_keys, shared_values, (index,), (first,)))
                    positions.append(self.groups.positions((kv.view,), {kv.view: kv.block}))
        return WindowedPass(self.loaded.layer_windows, [torch.tensor(p, dtype=torch.long) for p in fed],
                            [torch.tensor(p, dtype=torch.long) for p in own], segments, positions,
                            per_row=self.loaded.deterministic)

    def _segments(self, entries: Seq[ScheduledSeq], positions: list[torch.Tensor] | None = None):
        """The step's shared segments (BatchContext.segments); with `positions`, each one's key positions [n] appended
        to it in the same order (sliding windows)."""
        users: dict[KVView, list[tuple[int, int]]] = defaultdict(list)
        blocks = {}
        for index, entry in enumerate(entries):
            seq = entry.seq
            for shared in seq.shared:
                # Row offsets matter in a prefill step only (tokens positioned before the block), counted from
                # this chunk's first token; a sequence all of whose tokens this step precede the block skips it.
                offset = max(0, shared.visible_from - seq.prefill_done) if seq.status == SeqStatus.PREFILL else 0
                if offset < entry.num_tokens:
                    users[shared.view].append((index, offset))
                    blocks[shared.view] = shared.block
        # Attention over shared KV is permutation-invariant, so every block used by the same set of
        # (sequence, offset) pairs joins one segment, wherever its positions are.
        by_users: dict[tuple[tuple[int, int], ...], list[KVView]] = defaultdict(list)
        for view, found in users.items():
            by_users[tuple(found)].append(view)
        segments = []
        for pairs, views in by_users.items():
            indices = tuple(i for i, _ in pairs)
            offsets = tuple(o for _, o in pairs) if any(o for _, o in pairs) else None
            # keys and values [num_layers, num_kv_heads, sum n, head_dim] of each part, concatenated once
            for part in self.groups.split(views):
                segments.append((*self.groups.get(part, blocks), indices, offsets))
                if positions is not None:
                    positions.append(self.groups.positions(part, blocks))
        self.groups.trim()
        return segments


def _takes_argmax(entry: ScheduledSeq) -> bool:
    """Whether the entry's next token is its row's argmax and nothing else reads the row: a decoding sequence whose
    sampler `takes_argmax` (a prompt's last chunk also keeps its logits for exact repeats and forks n samples)."""
    seq = entry.seq
    return seq.status == SeqStatus.DECODE and seq.sampler is not None and seq.sampler.takes_argmax

