"""`--dtype auto` (bf16 where the CPU computes it natively) and bf16 against fp32 through the engine."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from promptcache.cache_store import KVBlock, dumps
from promptcache.model_runtime import ModelConfig, SamplingParams
from promptcache.model_runtime.cpu_features import auto_dtype, cpu_flags
from promptcache.model_runtime.engine import Engine, EngineConfig
from promptcache.model_runtime.loading.packed_linear import can_pack
from promptcache.server import ServerSettings
from tests.conftest import make_tiny_runtime

# An AMD EPYC without AVX-512 (this machine).
EPYC_AVX2 = frozenset(["fpu", "sse", "sse2", "avx", "avx2", "fma", "f16c"])
XEON_AMX = EPYC_AVX2 | {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}  # Sapphire Rapids
ZEN4 = EPYC_AVX2 | {"avx512f", "avx512_bf16"}


@pytest.mark.parametrize(("flags", "device", "expected"), [
    (EPYC_AVX2, "cpu", "float32"), (XEON_AMX, "cpu", "bfloat16"), (ZEN4, "cpu", "bfloat16"),
    (EPYC_AVX2 | {"avx512f"}, "cpu", "float32"),  # AVX-512 without bf16 arithmetic: fp32
    (frozenset(), "cpu", "float32"), (EPYC_AVX2, "cuda", "bfloat16"), (EPYC_AVX2, "cuda:1", "bfloat16"),
])
def test_auto_dtype_per_cpu_flags(flags, device, expected):
    assert auto_dtype(device, flags) == expected


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 amx_bf16 avx512_bf16\n\n"
                       "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(cpuinfo)) == {"fpu", "avx2", "amx_bf16", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "absent")) == frozenset()  # no /proc: assume nothing


def test_auto_is_the_server_default_and_resolves_on_this_machine(monkeypatch):
    monkeypatch.delenv("PROMPTCACHE_DTYPE", raising=False)
    assert ServerSettings().dtype == "auto"
    resolved = ModelConfig(dtype="auto").torch_dtype
    assert resolved == (torch.bfloat16 if auto_dtype("cpu") == "bfloat16" else torch.float32)
    with pytest.raises(ValueError, match="auto"):
        ModelConfig(dtype="int8")


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_bf16_engine_agrees_with_fp32_within_tolerance(packed):
    """Same weights in bf16 and fp32, through the batched engine: the next-token distributions agree within
    bf16's precision, and the stored KV takes half the bytes per token. `packed`: both with their linear
    weights packed for oneDNN, as the server loads them (where this CPU packs bf16)."""
    if packed and not can_pack(torch.bfloat16):
        pytest.skip("this CPU has no native bf16 for packed linears")
    fp32 = make_tiny_runtime("llama", pack_weights=packed)
    bf16 = make_tiny_runtime("llama", dtype=torch.bfloat16, pack_weights=packed)
    assert bf16.loaded.kv_bytes_per_token * 2 == fp32.loaded.kv_bytes_per_token
    schema = """<schema name="s"><module name="doc">The river flows north through the valley.</module></schema>"""
    prompts = ['<prompt schema="s"><doc/>Where does the river flow?</prompt>',
               '<prompt schema="s"><doc/>What is north of the valley?</prompt>']
    probs = []
    for runtime in (fp32, bf16):
        runtime.add_schema(runtime.parse_schema(schema))
        engine = Engine(runtime.module_encoder, EngineConfig(max_num_seqs=4))
        params = SamplingParams(max_tokens=1, temperature=0, logprobs=20)

        async def run(runtime=runtime, engine=engine, params=params):
            return await asyncio.gather(*(_first(engine.submit(runtime.plan(p), params)) for p in prompts))

        try:
            probs.append(asyncio.run(run()))
        finally:
            engine.stop()
    for want, got in zip(*probs):  # per prompt: fp32 vs bf16 top-20 probabilities
        shared = set(want) & set(got)
        assert len(shared) >= 15
        assert max(abs(want[t] - got[t]) for t in shared) <= 0.02
    block = fp32.store.get(fp32.store.tiers[0].keys()[0])[0]
    half = KVBlock(block.keys.to(torch.bfloat16), block.values.to(torch.bfloat16), block.position_ids)
    assert len(dumps(half, "k")) < 0.6 * len(dumps(block, "k"))


async def _first(stream) -> dict[int, float]:
    async for event in stream:
        assert event.report is None or event.report.error is None, event.report
        if event.logprobs is not None:
            return {token: math.exp(logprob) for token, logprob in event.logprobs.top}
    raise AssertionError("no token event")
