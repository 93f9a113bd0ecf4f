"""The Triton prototype of a decode step's shared-module attention (benchmarks/kernels/triton_decode.py)
against plain attention over each sequence's whole KV. On a GPU the kernels run compiled. Without one they
run in Triton's interpreter, which must be on before Triton is first imported (scripts/test.sh runs this file
with TRITON_INTERPRET=1: tests/model_runtime/triton_interpreter.py)."""

from __future__ import annotations

import pytest
import torch

from tests.model_runtime.triton_interpreter import skip_unless_kernels_run

DEVICE = skip_unless_kernels_run()

from benchmarks.kernels.triton_decode import shared_decode_attention  # noqa: E402  (needs triton: after the skip)

DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunks", [1, 3, 16])  # 16 chunks of 150 keys: the last one holds none
def test_matches_plain_attention_over_each_sequences_kv(dtype, chunks):
    g = torch.Generator().manual_seed(chunks)
    batch, heads, kv_heads, dim, shared, capacity = 5, 8, 2, 64, 150, 80
    lengths = [0, 3, 70, 17, 1]  # own KV lengths, an empty one among them

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

    q = rand(batch, heads, dim)
    shared_k, shared_v = rand(kv_heads, shared, dim), rand(kv_heads, shared, dim)
    pool_k, pool_v = rand(kv_heads, batch * capacity, dim), rand(kv_heads, batch * capacity, dim)
    first = torch.arange(batch, dtype=torch.int32, device=DEVICE) * capacity
    length = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    got = shared_decode_attention(q, shared_k, shared_v, pool_k, pool_v, first, length, dim ** -0.5, chunks)
    assert got.dtype == dtype and got.shape == q.shape
    for b, n in enumerate(lengths):
        own = slice(b * capacity, b * capacity + n)
        k = torch.cat([shared_k, pool_k[:, own]], 1).float().repeat_interleave(heads // kv_heads, 0)
        v = torch.cat([shared_v, pool_v[:, own]], 1).float().repeat_interleave(heads // kv_heads, 0)
        want = torch.nn.functional.scaled_dot_product_attention(q[b].float()[:, None], k, v, scale=dim ** -0.5)
        # fp32 on a GPU: Triton's dot takes fp32 inputs as TF32 (10-bit mantissas), as its default allows.
        tolerance = 2e-2 if dtype == torch.bfloat16 else (5e-3 if DEVICE == "cuda" else 1e-5)
        assert (got[b].float() - want[:, 0]).abs().max().item() <= tolerance
