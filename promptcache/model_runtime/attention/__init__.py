"""Shared-module attention kernels: pure torch on CPU and GPU (flash-attn, FlashInfer optional on GPU)."""

from promptcache.model_runtime.attention.lse_merge import merge_partials
from promptcache.model_runtime.attention.shared_attention import OwnPool, SharedSegment, shared_module_attention
from promptcache.model_runtime.attention.step_indices import StepIndices

__all__ = ["OwnPool", "SharedSegment", "StepIndices", "merge_partials", "shared_module_attention"]
