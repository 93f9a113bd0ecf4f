"""Prefix-cache writes a step leaves behind: the engine runs them after the step's events went out, so
storing blocks never delays a token. Each function returns the write to queue, or None."""

from __future__ import annotations

from collections.abc import Callable

import torch

from promptcache.model_runtime.engine.prefix import PrefixReuse
from promptcache.model_runtime.engine.request import Sequence

Write = Callable[[], None]


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

