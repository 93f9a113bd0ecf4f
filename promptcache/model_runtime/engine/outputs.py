"""OutputProcessor: a step's outputs turned into tokens, text, events and prefix writes (`postprocess`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from promptcache.cache_store import KVBlock
from promptcache.model_runtime.detokenizer import Detokenizer
from promptcache.model_runtime.engine.prefix import KVView, PrefixReuse
from promptcache.model_runtime.engine.reports import final_event
from promptcache.model_runtime.engine.request import FinishReason, SeqStatus, Sequence, SharedKV, TokenEvent
from promptcache.model_runtime.engine.runner import RunOutput
from promptcache.model_runtime.engine.scheduler import Scheduler
from promptcache.model_runtime.engine.step_plan import StepPlan
from promptcache.model_runtime.sampling import Draw, Sampler, sample_batch

logger = logging.getLogger(__name__)

# A prefix-cache write a step leaves, run after the step's events went out: storing blocks never delays a token.
Write = Callable[[], None]


@dataclass(frozen=True, slots=True)
class StepResult:
    """What a step leaves: events for the callers, then prefix-cache writes (`Write`)."""

    events: tuple[TokenEvent, ...]
    prefix_writes: tuple[Write, ...]


class OutputProcessor:
    """Advances the sequences that ran, samples and detokenizes, forks n > 1 samples, finishes samples."""

    def __init__(self, scheduler: Scheduler, prefix: PrefixReuse) -> None:
        self.scheduler = scheduler
        self.prefix = prefix
        self.loaded = scheduler.loaded

    def postprocess(self, plan: StepPlan, output: RunOutput) -> StepResult:
        """Fail the requests that broke the pass alone, then sample for each sequence whose prompt is computed
        (`plan.ready` first), all the step's samples together (`sample_batch`: one copy each way); a failure while
        sampling or detokenizing fails its request only."""
        events: list[TokenEvent] = [self.scheduler.fail(request, exc) for request, exc in output.failures]
        writes: list[Write | None] = []
        logits, rows = self._step_logits(plan, output)
        samples: list[tuple[Sequence, int]] = []  # (sequence, its logits row), in the order tokens go out
        for seq, row, step_ms in rows:
            request = seq.owner
            if request.is_failed:
                continue
            try:
                if seq.status == SeqStatus.PREFILL:
                    request.prefill_ms += step_ms
                    writes.append(logits_write(seq, logits[row], self.prefix))
                forks = self._fork(seq, writes) if seq.is_prompt else [seq]
                samples += [(self._start(fork, writes), row) for fork in forks]
            except Exception as exc:
                events.append(self.scheduler.fail(request, exc))
        draws = self._draw(samples, logits, None if plan.ready else output.greedy_ids)
        for (seq, _), draw in zip(samples, draws):
            request = seq.owner
            if request.is_failed:
                continue
            try:
                if draw.error is not None:
                    raise draw.error
                self._emit(seq, draw, events, writes)
            except Exception as exc:
                events.append(self.scheduler.fail(request, exc))
        return StepResult(tuple(events), tuple(w for w in writes if w is not None))

    def _step_logits(self, plan: StepPlan, output: RunOutput) -> tuple[torch.Tensor, list[tuple[Sequence, int, float]]]:
        """The step's logits [num_rows, vocab] on the pass's device (an exact repeat's cached CPU row copied there:
        a request samples on one device throughout) and (sequence, row, step_ms) of each sequence to sample."""
        rows: list[tuple[Sequence, int, float]] = []
        for index, (entry, found) in enumerate(zip(output.ran, output.prompt_logprobs)):
            seq, request = entry.seq, entry.seq.owner
            seq.advance(entry.num_tokens)
            if found is not None and request.prompt_logprobs is not None:
                request.prompt_logprobs.extend(found)
            if seq.status == SeqStatus.PREFILL and seq.pending_ids:
                request.prefill_ms += output.step_ms  # a chunk of a long prefill: nothing to sample yet
            else:
                rows.append((seq, len(plan.ready) + index, output.step_ms))
        if not plan.ready:
            return output.logits, rows
        device = output.logits.device if output.ran else self.loaded.model.device
        ready = torch.stack([row for _, row in plan.ready]).to(device, non_blocking=True)  # [num_ready, vocab]
        logits = torch.cat([ready, output.logits]) if output.ran else ready
        return logits, [(seq, index, 0.0) for index, (seq, _) in enumerate(plan.ready)] + rows

    def _draw(self, samples: list[tuple[Sequence, int]], logits: torch.Tensor,
              greedy_ids: torch.Tensor | None = None) -> list[Draw]:
        """Every sample's pick at once; if the batch itself breaks, each alone, so a bad row fails its request only.
        `greedy_ids` [num_rows]: each row's argmax, computed by the pass; taken as they are (one small copy back, the
        logits unread) where every sampler takes only the argmax."""
        samplers = [seq.sampler for seq, _ in samples if seq.sampler is not None]
        assert len(samplers) == len(samples), "a sample without its sampler"
        if greedy_ids is not None and samplers and all(sampler.takes_argmax for sampler in samplers):
            tokens = greedy_ids.tolist()  # the step's one device-to-host copy
            return [Draw(sampler.take(int(tokens[row]))) for sampler, (_, row) in zip(samplers, samples)]
        try:
            return sample_batch(samplers, logits, [row for _, row in samples])
        except Exception:
            logger.warning("sampling the step failed; sampling its %d rows one by one", len(samples), exc_info=True)
            draws = []
            for sampler, (_, row) in zip(samplers, samples):
                try:
                    draws += sample_batch([sampler], logits, [row])
                except Exception as alone:
                    draws.append(Draw(0, error=alone))
            return draws

    def _fork(self, prompt: Sequence, writes: list[Write | None]) -> list[Sequence]:
        """The prompt of n > 1 samples is computed: the n samples, to sample from its logits."""
        request = prompt.owner
        self.scheduler.finish(prompt)
        n = prompt.own_length
        keys, values = prompt.own_buffers()
        # The n samples reference the prompt's computed KV as one more shared block (a view, no copy).
        prompt_kv = SharedKV(KVView(f"{request.request_id}/prompt"), KVBlock(
            keys[:, :, :n], values[:, :, :n], torch.tensor(prompt.own_positions, dtype=torch.long)))
        writes.append(prompt_write(prompt, self.prefix))
        forks = []
        for index in range(request.params.n):
            seq = self.scheduler.new_sequence(request, index, [*prompt.shared, prompt_kv], request.params.max_tokens)
            seq.next_position = seq.first_position = prompt.next_position
            forks.append(seq)
        return forks

    def _start(self, seq: Sequence, writes: list[Write | None]) -> Sequence:
        """Before a sequence's first token (its prompt is computed): its sampler and detokenizer."""
        request = seq.owner
        if seq.sampler is None or seq.detokenizer is None:
            if seq.status == SeqStatus.PREFILL:
                writes.append(prompt_write(seq, self.prefix))
            seq.status = SeqStatus.DECODE
            seq.sampler = Sampler(request.params, seed_offset=seq.index, prompt=request.prompt_tokens)
            seq.detokenizer = Detokenizer(self.loaded.tokenizer, request.params.stop)
        return seq

    def _emit(self, seq: Sequence, draw: Draw, events: list[TokenEvent], writes: list[Write | None]) -> None:
        """Stream the drawn token's text, and finish on an end-of-sequence token, a stop string, max_tokens or the
        model's last position."""
        request, token, logprobs = seq.owner, draw.token_id, draw.logprobs
        params, detokenizer = request.params, seq.detokenizer
        assert detokenizer is not None
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        seq.output_ids.append(token)
        finish = None
        if token in self.loaded.eos_token_ids and not params.ignore_eos:
            finish, text = FinishReason.STOP, detokenizer.flush()
        else:
            text = detokenizer.push(token)
            if detokenizer.is_stopped:
                finish = FinishReason.STOP
            elif len(seq.output_ids) >= params.max_tokens or seq.next_position >= self.loaded.max_positions:
                finish = FinishReason.LENGTH
            if finish is not None:
                text += detokenizer.flush()
        if finish is None:
            seq.pending_ids, seq.pending_positions = [token], [seq.next_position]
            seq.next_position += 1
            events.append(TokenEvent(request.request_id, seq.index, token, text, logprobs=logprobs))
            return
        seq.status = SeqStatus.FINISHED
        writes.append(sample_write(seq, self.prefix))
        events.append(final_event(request, seq.index, token, text, finish, logprobs) if self.scheduler.finish(seq)
                      else TokenEvent(request.request_id, seq.index, token, text, finish, logprobs=logprobs))


def prompt_write(seq: Sequence, prefix: PrefixReuse) -> Write | None:
    """After prefill: store the prompt's blocks (its computed KV is seq's own [0, n))."""
    stream, n = seq.owner.stream, seq.generated_offset
    if stream is None:
        return None
    keys, values = seq.own_buffers()
    computed = (stream.num_reused, keys[:, :, :n], values[:, :, :n])
    salt, owner = seq.owner.cache_salt, seq.owner.tenant
    return lambda: prefix.store_prompt(stream, computed, salt=salt, owner=owner)


def logits_write(seq: Sequence, row: torch.Tensor, prefix: PrefixReuse) -> Write | None:
    """After a prefill that computed the last prompt token: keep its logits `row` [vocab]."""
    stream = seq.owner.stream
    if stream is None or stream.logits is not None:
        return None
    logits, salt = row.clone(), seq.owner.cache_salt
    return lambda: prefix.remember_logits(stream, logits, salt=salt)


def sample_write(seq: Sequence, prefix: PrefixReuse) -> Write | None:
    """After a sample finished: store its generated text's blocks."""
    stream = seq.owner.stream
    if stream is None:
        return None
    start, end = seq.generated_offset, seq.own_length
    keys, values = seq.own_buffers()
    generated = (len(stream.token_ids), keys[:, :, start:end], values[:, :, start:end])
    output_ids, first = list(seq.output_ids), seq.first_position
    salt, owner = seq.owner.cache_salt, seq.owner.tenant
    return lambda: prefix.store_sample(stream, output_ids, first, generated, salt=salt, owner=owner)
