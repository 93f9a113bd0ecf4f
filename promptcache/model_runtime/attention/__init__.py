"""Shared-module attention kernels (pure torch; flash-attn optional on GPU)."""

from promptcache.model_runtime.attention.lse_merge import merge_partials
from promptcache.model_runtime.attention.segments import SharedSegment
from promptcache.model_runtime.attention.shared_attention import shared_module_attention

__all__ = ["SharedSegment", "merge_partials", "shared_module_attention"]
