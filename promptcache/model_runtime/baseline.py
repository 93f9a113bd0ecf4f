"""Full prefill without any cache: the oracle for exactness tests and the TTFT benchmark baseline."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from promptcache.model_runtime.packed_attention import cache_argument, past_cache


@torch.inference_mode()
def full_prefill_logits(model, token_ids: Sequence[int], position_ids: Sequence[int] | None = None,
                        attention_mask: torch.Tensor | Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Logits [n, vocab] (float32) of one plain forward pass over `token_ids`; `attention_mask` [1, 1, n, n] (True: may
    attend) or, for models mixing local and full layers, one per layer type (transformers' own mapping), else causal
    (all-ones 2-D: else transformers reads a position jump as a new packed sequence)."""
    device = model.device
    input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)  # [1, n]
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    kwargs: dict = {"attention_mask": ({kind: m.to(device) for kind, m in mask.items()} if isinstance(mask, Mapping)
                                       else mask.to(device))}
    if position_ids is not None:
        kwargs["position_ids"] = torch.tensor([list(position_ids)], dtype=torch.long, device=device)  # [1, n]
    return model(input_ids=input_ids, use_cache=False, **kwargs).logits[0].float()


@torch.inference_mode()
def full_prefill_greedy(model, token_ids: Sequence[int], position_ids: Sequence[int], num_tokens: int,
                        eos_token_ids: Sequence[int] = ()) -> list[int]:
    """Greedy tokens after a full prefill, decoding with the model's own (HF) KV cache."""
    return full_prefill_generate(model, token_ids, position_ids, num_tokens, eos_token_ids)[0]


@torch.inference_mode()
def full_prefill_generate(model, token_ids: Sequence[int], position_ids: Sequence[int], num_tokens: int,
                          eos_token_ids: Sequence[int] = ()) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after a full prefill and the logits [vocab] (float32) the first one was picked from."""
    device = model.device
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)       # [1, n]
    pos = torch.tensor([list(position_ids)], dtype=torch.long, device=device)    # [1, n]
    out = model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=True)
    past, next_pos = past_cache(out), int(pos[0, -1]) + 1
    tokens: list[int] = []
    logits = out.logits[0, -1]
    first_logits = logits.float()
    for _ in range(num_tokens):
        token = int(torch.argmax(logits))
        tokens.append(token)
        if token in eos_token_ids:
            break
        mask = torch.ones((1, past.get_seq_length() + 1), dtype=torch.long, device=device)  # [1, kv_len]
        out = model(input_ids=torch.tensor([[token]], device=device),
                    position_ids=torch.tensor([[next_pos]], device=device),
                    attention_mask=mask, use_cache=True, **cache_argument(model, past))
        past, next_pos, logits = past_cache(out), next_pos + 1, out.logits[0, -1]
    return tokens, first_logits
