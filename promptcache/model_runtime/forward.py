"""Forward passes over an HF causal LM for one sequence: hidden states at given positions, last logits."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch

from promptcache.model_runtime.kv_buffer import KVBuffer
from promptcache.model_runtime.packed_attention import BatchCache, BatchContext, active_batch


def run_tokens(model, buffer: KVBuffer, token_ids: Sequence[int], position_ids: Sequence[int]) -> torch.Tensor:
    """Feed `token_ids` at `position_ids` after the states in `buffer`; returns the last hidden state.

    Every new token attends to all states in the buffer and causally to the new tokens before it: the
    buffer's filled part is one shared segment, the new tokens the sequence's own KV (shared-module
    attention with a batch of one, so GQA needs no KV copies). New states are written into `buffer`.
    Returns [hidden_size] for the last token; the LM head is left to the caller.
    """
    device = buffer.keys.device
    n, start = len(token_ids), buffer.length
    if start + n > buffer.capacity:
        raise RuntimeError(f"KV buffer overflow: {start + n} > capacity {buffer.capacity}")
    input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)     # [1, n]
    positions = torch.tensor([list(position_ids)], dtype=torch.long, device=device)  # [1, n]
    keys, values = buffer.keys[:, 0], buffer.values[:, 0]                             # [L, H_kv, capacity, D]
    segments = [(keys[:, :, :start], values[:, :, :start], (0,), None)] if start else []
    context = BatchContext(query_lens=[n], own_keys=[keys[:, :, start:]], own_values=[values[:, :, start:]],
                           own_starts=[0], segments=segments)
    with active_batch(context):
        outputs = model.base_model(input_ids=input_ids, position_ids=positions, use_cache=True,
                                   **cache_argument(model.base_model, BatchCache(context, buffer.num_layers)))
    buffer.length = start + n
    return outputs.last_hidden_state[0, -1]  # [hidden]


def logits_of(model, hidden: torch.Tensor) -> torch.Tensor:
    """[hidden] -> [vocab] float32 logits through the model's LM head."""
    return model.get_output_embeddings()(hidden).float()


def cache_argument(model, cache) -> dict:
    """The keyword argument that hands `cache` to `model`'s forward: `cache` where the model takes it
    (transformers renamed `past_key_values`, and warns on every call that passes the old name), else
    `past_key_values`."""
    return {_cache_keyword(type(model)): cache}


def past_cache(outputs):
    """The KV cache a forward pass returned, under either name (see `cache_argument`)."""
    found = getattr(outputs, "cache", None)
    return found if found is not None else outputs.past_key_values


@functools.cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"
