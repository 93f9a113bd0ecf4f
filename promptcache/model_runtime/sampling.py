"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

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
    """How to pick tokens. `temperature == 0` is greedy; `n` samples share the prompt's KV."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
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


class Sampler:
    """Picks the next token from logits; one instance per sequence (it owns the RNG state)."""

    def __init__(self, params: SamplingParams, *, seed_offset: int = 0) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed + seed_offset)

    def sample(self, logits: torch.Tensor) -> int:
        """`logits`: [vocab] float. Returns a token id."""
        params = self.params
        if params.is_greedy:
            return int(torch.argmax(logits))
        scores = logits.float() / params.temperature  # [vocab]
        if params.top_k > 0:
            kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if not bool(torch.isfinite(probs).all()):
            raise FloatingPointError("the sampling distribution is not finite (non-finite logits)")
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the token crossing it stays).
            drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator))
