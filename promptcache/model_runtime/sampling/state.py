"""A sequence's sampling state across steps: its parameters, seeded generator, generated-token counts and the
prompt's ids; `batch.sample_batch` reads and updates it for a whole step's rows at once."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from promptcache.model_runtime.sampling.batch import batch_scores, sample_batch
from promptcache.model_runtime.sampling.params import SamplingParams


class PromptTokens:
    """A prompt's token ids as `repetition_penalty` reads them: a [vocab] mask built on first use, shared by the
    request's samples, on the device last asked for (cached CPU logits, then the model's)."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self._token_ids = torch.tensor(list(token_ids), dtype=torch.long)  # [num_prompt_tokens]
        self._mask: torch.Tensor | None = None

    def mask(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[vocab_size] bool: True at every id that occurs in the prompt (reused or computed)."""
        if self._mask is None:
            self._mask = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, self._token_ids, True)  # [vocab]
        if self._mask.device != torch.device(device):
            self._mask = self._mask.to(device)
        return self._mask


class Sampler:
    """One sequence's sampling state. Owns its seeded generator (one per device, each seeded with `seed +
    seed_offset`) and the generated-token counts the penalties read; without `prompt`, `repetition_penalty`
    covers the generated tokens only. Tokens are picked for a step's rows together (`batch.sample_batch`)."""

    def __init__(self, params: SamplingParams, *, seed_offset: int = 0, prompt: PromptTokens | None = None) -> None:
        self.params = params
        self.prompt = prompt if params.uses_prompt_tokens else None
        self._seed = None if params.seed is None else params.seed + seed_offset
        self._generators: dict[torch.device, torch.Generator] = {}
        if self._seed is not None:  # the CPU's made now, as always: draws from it are today's draws
            self._generators[torch.device("cpu")] = torch.Generator().manual_seed(self._seed)
        self.counts: torch.Tensor | None = None  # [vocab] float32: times each token was generated (a row view)
        self._unseen: list[int] = []  # recorded tokens not yet added to `counts`

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The seeded generator on `device` (None: unseeded, or a device without generators, such as meta).
        A CUDA generator draws there: no host work per step, reproducible on the same kind of GPU."""
        if self._seed is None or device.type not in ("cpu", "cuda"):
            return None
        found = self._generators.get(device)
        if found is None:
            found = self._generators[device] = torch.Generator(device=device).manual_seed(self._seed)
        return found

    def take_unseen(self) -> list[int]:
        """The tokens recorded since the last step, to add to `counts` now (emptied)."""
        unseen, self._unseen = self._unseen, []
        return unseen

    def record(self, token_id: int) -> None:
        """Add a generated token to the history the penalties read (`sample_batch` records its own picks)."""
        if self.params.uses_history:
            self._unseen.append(token_id)

    def sample(self, logits: torch.Tensor) -> int:
        """`logits`: [vocab] float. Picks this row alone (as the engine's step would), records and returns the token;
        raises FloatingPointError for a distribution that is not finite."""
        draw = sample_batch([self], logits.unsqueeze(0))[0]
        if draw.error is not None:
            raise draw.error
        return draw.token_id

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [vocab] -> scores [vocab] float32 (-inf: excluded) in SamplingParams' order, as `sample` reads
        them (plain greedy: the logits). Adds recorded tokens to `counts`; records nothing."""
        return batch_scores([self], logits.unsqueeze(0))[0]

    @property
    def takes_argmax(self) -> bool:
        """Whether this sampler's next pick is its logits row's argmax and nothing else of the row is read (plain
        greedy, no logprobs): a pass that computed the argmax on the device can hand it to `take`."""
        return self.params.is_plain_greedy and self.params.logprobs is None

    def take(self, token_id: int) -> int:
        """Record `token_id`, the argmax computed elsewhere for plain greedy params, and return it."""
        assert self.params.is_plain_greedy, "only plain greedy sampling takes a precomputed argmax"
        self.record(token_id)
        return token_id
