"""StepInputs: what a step's sampling needs on the device, decided on the host from the rows' parameters (which
processors run at all, which rows each covers) and copied in one transfer (HostPack)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from promptcache.model_runtime.sampling.host_pack import DevicePack, HostPack

if TYPE_CHECKING:
    from promptcache.model_runtime.sampling.state import Sampler


@dataclass(eq=False)
class StepInputs:
    """One step's rows (samplers[b] reads logits row rows[b]) and their parameters as device sections of `pack`.
    The flags say which processors some row uses; a row a processor does not cover gets its neutral value."""

    samplers: Sequence[Sampler]
    vocab_size: int
    device: torch.device
    pack: DevicePack
    rows: tuple[int, ...] | None = None
    sampled: tuple[int, ...] = ()       # rows drawn at random (the rest: argmax)
    is_all_sampled: bool = False
    penalised: tuple[int, ...] = ()     # rows with a penalty (they keep generated-token counts)
    logprob_rows: tuple[int, ...] = ()  # rows that report logprobs
    max_top: int = 0                    # most top logprobs a row asks for
    max_k: int = 0                      # largest top-k cut (0: no row cuts)
    has_bias: bool = False
    has_repetition: bool = False
    has_counts_terms: bool = False      # presence or frequency penalties
    has_temperature: bool = False
    has_top_p: bool = False
    has_min_p: bool = False
    num_unseen: int = 0
    errors: dict[int, Exception] = field(default_factory=dict)  # rows that fail alone, by row

    @classmethod
    def build(cls, samplers: Sequence[Sampler], vocab_size: int, rows: Sequence[int] | None,
              device: torch.device) -> StepInputs:
        """Gather every section on the host and copy them to `device` at once. Takes the samplers' unseen tokens."""
        host, params = HostPack(), [s.params for s in samplers]
        flags: dict = {"errors": {}}
        if rows is not None:
            host.ints("rows", rows)
        # Warpers apply to rows sampled with a temperature; a plain greedy row is its logits' argmax.
        warped = [p.temperature > 0 and not p.is_plain_greedy for p in params]
        bias_at, bias = [], []
        for b, p in enumerate(params):
            for token, value in p.logit_bias:
                if token >= vocab_size:
                    flags["errors"][b] = IndexError(f"logit_bias token id {token} is outside the vocabulary "
                                                    f"[0, {vocab_size})")
                    continue
                bias_at.append(b * vocab_size + token)
                bias.append(value)
        if bias:
            host.ints("bias_at", bias_at)
            host.floats("bias", bias)
            flags["has_bias"] = True
        penalised = tuple(b for b, p in enumerate(params) if p.uses_history)
        if penalised:
            chosen = [params[b] for b in penalised]
            host.ints("penalised", penalised)
            unseen = [i * vocab_size + t for i, b in enumerate(penalised) for t in samplers[b].take_unseen()]
            host.ints("unseen", unseen)
            host.floats("repetition", [p.repetition_penalty for p in chosen])
            host.floats("presence", [p.presence_penalty for p in chosen])
            host.floats("frequency", [p.frequency_penalty for p in chosen])
            flags.update(penalised=penalised, num_unseen=len(unseen),
                         has_repetition=any(p.repetition_penalty != 1.0 for p in chosen),
                         has_counts_terms=any(p.presence_penalty or p.frequency_penalty for p in chosen))
        if any(w and p.temperature != 1.0 for w, p in zip(warped, params)):
            host.floats("temperature", [p.temperature if w else 1.0 for w, p in zip(warped, params)])
            flags["has_temperature"] = True
        top_k = [min(p.top_k, vocab_size) if w else 0 for w, p in zip(warped, params)]
        if any(top_k):
            host.ints("top_k", top_k)
            flags["max_k"] = max(top_k)
        if any(w and p.top_p < 1.0 for w, p in zip(warped, params)):
            # 1 - top_p in double, as the per-row code compared a float32 cumsum with that Python float.
            host.floats("top_p_drop", [1 - p.top_p if w and p.top_p < 1.0 else -1.0 for w, p in zip(warped, params)])
            flags["has_top_p"] = True
        if any(w and p.min_p > 0 for w, p in zip(warped, params)):
            host.floats("min_p", [p.min_p if w else 0.0 for w, p in zip(warped, params)])
            flags["has_min_p"] = True
        sampled = tuple(b for b, p in enumerate(params) if not p.is_greedy)
        if sampled:
            host.ints("sampled", sampled)
            flags.update(sampled=sampled, is_all_sampled=len(sampled) == len(params))
        logprob_rows = tuple(b for b, p in enumerate(params) if p.logprobs is not None)
        if logprob_rows:
            host.ints("logprob_rows", logprob_rows)
            flags.update(logprob_rows=logprob_rows, max_top=max(params[b].logprobs or 0 for b in logprob_rows))
        return cls(samplers, vocab_size, device, host.to(device), None if rows is None else tuple(rows), **flags)

    def counts(self) -> torch.Tensor:
        """[P, V] float32 generated-token counts of the penalised rows, brought up to date with the tokens
        recorded since their last step; each sampler keeps its row (a view) for the next step."""
        chosen = [self.samplers[b] for b in self.penalised]
        zero: torch.Tensor | None = None
        parts = []
        for sampler in chosen:
            found = sampler.counts
            if found is None:
                if zero is None:
                    zero = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)  # [V]
                found = zero
            parts.append(found if found.device == self.device else found.to(self.device))
        counts = torch.stack(parts)                                                               # [P, V]
        if self.num_unseen:
            unseen = self.pack.ints("unseen")
            counts.view(-1).index_add_(0, unseen, torch.ones(self.num_unseen, device=self.device))
        for i, sampler in enumerate(chosen):
            sampler.counts = counts[i]
        return counts

    def prompt_seen(self) -> torch.Tensor | None:
        """[P, V] bool: the prompt's ids of each penalised row whose repetition penalty reads them (None: no row)."""
        chosen = [self.samplers[b] for b in self.penalised]
        if not self.has_repetition or all(s.prompt is None for s in chosen):
            return None
        none = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)                # [V]
        return torch.stack([none if s.prompt is None else s.prompt.mask(self.vocab_size, self.device)
                            for s in chosen])                                                     # [P, V]
