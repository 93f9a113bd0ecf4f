"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, min-p, penalties, logit bias,
seeded (Hugging Face generation semantics)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20
MIN_TEMPERATURE = 1e-3  # below this (but above 0) logits / temperature overflows: use 0 for greedy
MAX_SEED = 2**63 - 1


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The sampled token's log-probability under the model's distribution (before temperature, top-k
    or top-p) and the `logprobs` most likely tokens with theirs, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, token: int, num_top: int) -> TokenLogprobs:
    """`logits`: [vocab]. The log-softmax of the raw logits at `token` and its `num_top` largest."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [vocab]
    top = torch.topk(logprobs, num_top) if num_top else None
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
    return TokenLogprobs(float(logprobs[token]), pairs)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens. `temperature == 0` is greedy; `n` samples share the prompt's KV.

    Logits processors run first, in Hugging Face's order (`logit_bias` as SequenceBiasLogitsProcessor with
    single tokens, then `repetition_penalty` over prompt and generated tokens), then OpenAI's
    `presence_penalty`/`frequency_penalty` over generated tokens; greedy picks the argmax of those. Sampling
    then applies HF's warpers in order: temperature, `top_k`, `top_p`, `min_p`.
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # report each sampled token's logprob and this many top alternatives
    # Report each prompt token's logprob (given the tokens before it) and this many alternatives. The
    # prompt is then computed in full: reused KV carries no logits.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0 or 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {self.temperature}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2^63 - 1], got {self.seed}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 10:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if any(not -100 <= bias <= 100 for _, bias in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if any(token < 0 for token, _ in self.logit_bias):
            raise ValueError("logit_bias token ids must be >= 0")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def uses_prompt_tokens(self) -> bool:
        """Whether sampling depends on the prompt's token ids (HF's repetition penalty covers them)."""
        return self.repetition_penalty != 1.0


class Sampler:
    """Picks the next token from logits; one instance per sequence (it owns the RNG state and the token
    history the penalties need: a seen-mask over prompt + generated tokens, counts of generated ones)."""

    def __init__(self, params: SamplingParams, *, seed_offset: int = 0, prompt_ids: Sequence[int] = ()) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed + seed_offset)
        self._prompt_ids = list(prompt_ids) if params.uses_prompt_tokens else []
        self._seen: torch.Tensor | None = None    # [vocab] bool: prompt and generated tokens
        self._counts: torch.Tensor | None = None  # [vocab] float: generated tokens

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [vocab] -> processed scores [vocab] float (-inf: excluded): processors, then (unless
        greedy) the warpers. softmax of the result is the distribution `sample` draws from."""
        params = self.params
        scores = logits.float().clone()  # [vocab]
        if params.logit_bias:
            ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
            scores[ids] += torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
        if params.repetition_penalty != 1.0:
            seen = self._history(scores)[0]
            picked = scores[seen]
            scores[seen] = torch.where(picked < 0, picked * params.repetition_penalty,
                                       picked / params.repetition_penalty)
        if params.presence_penalty or params.frequency_penalty:
            counts = self._history(scores)[1]
            scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
        if params.is_greedy:
            return scores
        scores = scores / params.temperature
        if params.top_k > 0:
            kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if params.top_p < 1.0:  # HF: drop the lowest tokens whose total mass is at most 1 - top_p
            ascending, order = torch.sort(scores)
            drop = torch.softmax(ascending, dim=-1).cumsum(dim=-1) <= 1 - params.top_p
            drop[-1] = False  # the most likely token always stays
            scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        if params.min_p > 0:
            probs = torch.softmax(scores, dim=-1)
            scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
        return scores

    def sample(self, logits: torch.Tensor) -> int:
        """`logits`: [vocab] float. Returns a token id (and records it in the history)."""
        scores = self.scores(logits)
        if self.params.is_greedy:
            token = int(torch.argmax(scores))
        else:
            probs = torch.softmax(scores, dim=-1)
            if not bool(torch.isfinite(probs).all()):
                raise FloatingPointError("the sampling distribution is not finite (non-finite logits)")
            token = int(torch.multinomial(probs.cpu(), 1, generator=self.generator))
        if self._seen is not None:
            self._seen[token] = True
        if self._counts is not None:
            self._counts[token] += 1
        return token

    def _history(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._seen is None:
            vocab = scores.numel()
            self._seen = torch.zeros(vocab, dtype=torch.bool, device=scores.device)
            prompt = [t for t in self._prompt_ids if 0 <= t < vocab]
            if prompt:
                self._seen[torch.tensor(prompt, dtype=torch.long, device=scores.device)] = True
            self._counts = torch.zeros(vocab, dtype=torch.float32, device=scores.device)
        assert self._counts is not None
        return self._seen, self._counts
