"""Handing a KV cache to an HF model's forward pass, and taking it back, under either of its names."""

from __future__ import annotations

import functools
import inspect

import torch


def cache_argument(model, cache) -> dict:
    """The keyword argument that hands `cache` to `model`'s forward: `cache` where the model takes it
    (transformers renamed `past_key_values`, and warns on every call that passes the old name), else
    `past_key_values`."""
    return {_cache_keyword(type(model)): cache}  # type: ignore[arg-type]  # mypy takes classes for unhashable


def past_cache(outputs):
    """The KV cache a forward pass returned, under either name (see `cache_argument`)."""
    found = getattr(outputs, "cache", None)
    return found if found is not None else outputs.past_key_values


@functools.cache
def _cache_keyword(model_class: type[torch.nn.Module]) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"
