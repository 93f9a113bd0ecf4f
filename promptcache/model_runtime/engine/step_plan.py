"""StepPlan: what one engine step runs, and the batch policy that composes it (`compose_step`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from promptcache.model_runtime.engine.request import Request, SeqStatus, Sequence, TokenEvent


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """A sequence in a step, feeding its next `num_tokens` pending tokens (a decode, a prompt, or a chunk)."""

    seq: Sequence
    num_tokens: int


@dataclass(frozen=True, slots=True)
class EncodeNeed:
    """Module KV a parked request waits for; `recompute`: a tier holds it, but the fetch policy refused it."""

    request: Request
    segment_id: int
    context_ids: tuple[int, ...]
    recompute: bool = False


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step as `Scheduler.schedule` composed it; the engine adds the module-encoding chunk."""

    batch: tuple[ScheduledSeq, ...]
    prefill_budget: int  # prompt tokens the batch leaves to module encoding
    # Sequences whose first token's logits [vocab] are known without a pass (an exact repeat).
    ready: tuple[tuple[Sequence, torch.Tensor], ...] = ()
    events: tuple[TokenEvent, ...] = ()  # final events of requests aborted, refused or failed while scheduling
    encodes: tuple[EncodeNeed, ...] = ()  # for requests parked this step (each once)
    encoding: ScheduledSeq | None = None  # a chunk of the active module encoding, run with the batch

    @property
    def has_forward(self) -> bool:
        return bool(self.batch) or self.encoding is not None

    @property
    def num_decoding(self) -> int:
        return sum(1 for s in self.batch if s.seq.status != SeqStatus.PREFILL)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt and module tokens fed (the decodes' aside)."""
        chunks = [s for s in self.batch if s.seq.status == SeqStatus.PREFILL]
        return sum(s.num_tokens for s in chunks) + (self.encoding.num_tokens if self.encoding is not None else 0)


def compose_step(running: Seq[Sequence], *, mixed_budget: int, alone_budget: int,
                 max_rows: int | None = None, min_tokens: int = 1) -> tuple[tuple[ScheduledSeq, ...], int]:
    """The step's batch and the prefill budget it leaves. Decodes run and prefills share `mixed_budget` (`alone_budget`
    with nothing decoding), lighter tenants first; beside decodes, a prompt within half that budget of its end is fed
    whole. A tenant with nothing decoding whose prompts fit `alone_budget` gets a step of its own. Under `max_rows` a
    step with decodes runs at most that many rows: lighter tenants' decodes first, then in `running` order (the
    scheduler rotates them), keeping `min_tokens` for prompts."""
    load = Counter(_tenant(s) for s in running)  # running sequences per tenant
    decoding = [s for s in running if s.pending_ids and s.status != SeqStatus.PREFILL]
    prefills = sorted((s for s in running if s.pending_ids and s.status == SeqStatus.PREFILL),
                      key=lambda s: load[_tenant(s)])  # stable: the order of `running` kept
    busy = {_tenant(s) for s in decoding}
    light = [s for s in prefills if _tenant(s) not in busy]
    if decoding and light and sum(len(s.pending_ids) for s in light) <= alone_budget:
        batch = tuple(ScheduledSeq(s, len(s.pending_ids)) for s in light)
        return batch, alone_budget - sum(s.num_tokens for s in batch)
    budget = mixed_budget if decoding else alone_budget
    if max_rows is not None and decoding:
        reserve = min(budget, sum(len(s.pending_ids) for s in prefills), min_tokens)
        decoding = sorted(decoding, key=lambda s: load[_tenant(s)])[:max(1, max_rows - reserve)]
        budget = min(budget, max(reserve, max_rows - len(decoding)))
    scheduled = [ScheduledSeq(s, len(s.pending_ids)) for s in decoding]
    # A prompt whose rest is within half the budget is finished now: a question split into a chunk and a tail of a
    # few tokens would wait a whole step more for its first token (not under a row cap: that bounds a tenant's share).
    finish_within = budget // 2 if decoding and max_rows is None else 0
    for seq in prefills:
        if budget <= 0:
            break
        left = len(seq.pending_ids) - budget
        scheduled.append(ScheduledSeq(seq, len(seq.pending_ids) if left <= finish_within else budget))
        budget -= scheduled[-1].num_tokens
    return tuple(scheduled), max(budget, 0)


def _tenant(seq: Sequence) -> str | None:
    request = seq.request
    if request is None:
        raise ValueError(f"sequence {seq.seq_id} encodes a module and belongs to no request")
    return request.tenant
