"""The lone-sequence GPU path (`attend_concatenated`) reading grouped KV with SDPA's enable_gqa, run on the CPU:
equal to the path that expands KV to every query head and to plain attention, for decode and prefill rows."""

from __future__ import annotations

import pytest
import torch

from promptcache.model_runtime.attention import gpu_backends


def _plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D] over k/v [H_kv, N, D], the last T keys its own (bottom-right causal): [T, H, D] in float64."""
    num_rows, num_heads, _ = q.shape
    group, n = num_heads // k.shape[0], k.shape[1]
    k, v = k.double().repeat_interleave(group, dim=0), v.double().repeat_interleave(group, dim=0)  # [H, N, D]
    scores = torch.einsum("thd,hnd->htn", q.double(), k) * scale                                  # [H, T, N]
    visible = torch.arange(n)[None, :] <= torch.arange(num_rows)[:, None] + n - num_rows           # [T, N]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("htn,hnd->thd", torch.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("num_rows", [1, 5])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (4, 4), (8, 1)])
def test_grouped_kv_equals_expanded_kv_and_plain_attention(monkeypatch, num_rows, num_heads, num_kv_heads):
    g = torch.Generator().manual_seed(num_rows * 10 + num_heads)
    head_dim, scale = 16, 0.25
    q = torch.randn(num_rows, num_heads, head_dim, generator=g)                                  # [T, H, D]
    keys = [torch.randn(num_kv_heads, n, head_dim, generator=g) for n in (37, 9 + num_rows)]     # shared, own
    values = [torch.randn(num_kv_heads, k.shape[1], head_dim, generator=g) for k in keys]
    calls = []
    real_repeat = torch.Tensor.repeat_interleave

    def spy(self, *args, **kwargs):
        calls.append(self.shape)
        return real_repeat(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "repeat_interleave", spy)
    outs, copies = {}, {}
    for grouped in (True, False):
        monkeypatch.setattr(gpu_backends, "concatenated_reads_groups", lambda _q, grouped=grouped: grouped)
        calls.clear()
        outs[grouped] = gpu_backends.attend_concatenated(q, keys, values, scale)                 # [T, H, D]
        copies[grouped] = len(calls)
    monkeypatch.undo()
    expected = _plain(q, torch.cat(keys, dim=1), torch.cat(values, dim=1), scale)
    torch.testing.assert_close(outs[True].double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[False].double(), expected, rtol=1e-5, atol=1e-5)
    assert copies[True] == 0  # grouped KV read as it lies: no copy per query head
    assert copies[False] == (2 if num_kv_heads != num_heads else 0)
