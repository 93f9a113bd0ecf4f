"""Which attention implementation a loaded model runs on, and why: the server logs it at startup and
/health reports it, so a slow fallback (no bf16 kernel built, a CPU without the instructions) is visible."""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass

import torch

from promptcache.model_runtime import avx2
from promptcache.model_runtime.attention import bf16_kernel, dispatch, gpu_backends, shared_prefix


class AttentionPath(str, enum.Enum):
    BF16_KERNEL = "bf16_kernel"  # our AVX512-BF16 kernel (CPU, bf16), built ahead of time
    AVX2_KERNEL = "avx2_kernel"  # our AVX2 decode kernel (CPU, fp32), built ahead of time; prompts: torch's fused op
    TORCH_FUSED_CPU = "torch_fused_cpu"  # torch's fused CPU attention op
    TORCH_GPU = "torch_gpu"  # torch's fused CUDA ops (flash-attn / FlashInfer first when installed)
    TRITON_SHARED = "triton_shared"  # our shared-prefix Triton kernel (GPU, bf16/fp16), torch's CUDA ops elsewhere
    MATMUL = "matmul"  # the reference kernel


@dataclass(frozen=True, slots=True)
class AttentionReport:
    """The path and one sentence on why it was chosen (no file paths: /health is open)."""

    path: AttentionPath
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path.value, "reason": self.reason}


def describe(backend: str, device: torch.device, dtype: torch.dtype) -> AttentionReport:
    """The path prompts take on `device` in `dtype` with `backend` (the bf16 kernel counts once prepare() ran)."""
    if backend == "matmul":
        return AttentionReport(AttentionPath.MATMUL, "attention backend 'matmul' configured")
    if (backend == "auto" and device.type in shared_prefix.KERNEL_DEVICE_TYPES and dtype in shared_prefix.KERNEL_DTYPES
            and shared_prefix.triton_installed()):
        return AttentionReport(AttentionPath.TRITON_SHARED, "the shared-prefix Triton kernel for passes whose own KV "
                               "is in the pool; torch's CUDA ops for the others and for module encoding")
    if device.type in dispatch.GPU_DEVICE_TYPES:
        optional = [name for name in gpu_backends.OPTIONAL_KERNELS if importlib.util.find_spec(name) is not None]
        first = f"{' and '.join(optional)} first where applicable, then " if optional else ""
        return AttentionReport(AttentionPath.TORCH_GPU, f"{first}torch's flash and memory-efficient CUDA ops")
    if backend == "flash":
        return AttentionReport(AttentionPath.MATMUL, "attention backend 'flash' is the reference kernel on a CPU")
    if backend == "fused_cpu":
        return AttentionReport(AttentionPath.TORCH_FUSED_CPU, "attention backend 'fused_cpu' configured")
    if dtype == torch.float32 and avx2.KERNELS.prepare() is not None:
        return AttentionReport(AttentionPath.AVX2_KERNEL, "decode steps through our AVX2 fp32 kernel (built ahead of "
                               "time); prompts through torch's fused op")
    if dtype != torch.bfloat16:
        return AttentionReport(AttentionPath.TORCH_FUSED_CPU, f"the model runs in {str(dtype).removeprefix('torch.')}; "
                               "the bf16 kernel serves bfloat16 only")
    if bf16_kernel.loaded() is not None:
        return AttentionReport(AttentionPath.BF16_KERNEL, "AVX512-BF16 kernel loaded (built ahead of time)")
    reason = bf16_kernel.unavailable_reason() or "the bf16 kernel was not loaded"
    return AttentionReport(AttentionPath.TORCH_FUSED_CPU, reason)
