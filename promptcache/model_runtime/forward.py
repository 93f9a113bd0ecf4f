"""Thin forward-pass helpers over an HF causal LM: hidden states at given positions, last logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from promptcache.model_runtime.kv_buffer import KVBuffer


def run_tokens(model, buffer: KVBuffer, token_ids: Sequence[int], position_ids: Sequence[int]) -> torch.Tensor:
    """Feed `token_ids` at `position_ids` after the states in `buffer`; returns the last hidden state.

    Every new token attends to all states in the buffer and causally to the new tokens before it
    (HF builds that mask from the cache length). States of the new tokens are appended to `buffer`.
    Returns [hidden_size] for the last token. Skips the LM head (callers ask for logits once).
    """
    device = buffer.keys.device
    input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)     # [1, n]
    positions = torch.tensor([list(position_ids)], dtype=torch.long, device=device)  # [1, n]
    outputs = model.base_model(input_ids=input_ids, position_ids=positions, past_key_values=buffer, use_cache=True)
    return outputs.last_hidden_state[0, -1]  # [hidden]


def logits_of(model, hidden: torch.Tensor) -> torch.Tensor:
    """[hidden] -> [vocab] float32 logits through the model's LM head."""
    return model.get_output_embeddings()(hidden).float()
