"""fp32 decode kernels for x86-64 CPUs with AVX2 and FMA but no AVX-512 (csrc/, built by `promptcache build-kernels`,
only loaded here): the int4 product for few rows, so a 4-bit GGUF is served as stored where PyTorch's int4 kernel has
no vector code, and the Q8_0 one for a GGUF's 8-bit layers and head; a decode step's attention as one call a layer
(the bf16 kernel's DecodeBatch, in fp32, head dims 64, 128 and 256); the fused decoder layers' element-wise ops."""

from promptcache.model_runtime.avx2.kernels import (
    DECODE_HEAD_DIMS,
    KERNELS,
    LIBRARY,
    Int8Ops,
    decode_batch_type,
    fused_ops,
    int4_ops,
    int8_ops,
)

__all__ = ["DECODE_HEAD_DIMS", "KERNELS", "LIBRARY", "Int8Ops", "decode_batch_type", "fused_ops", "int4_ops",
           "int8_ops"]
