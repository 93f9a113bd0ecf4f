"""Prepacked oneDNN linears against plain torch.nn.Linear (the oracle), alone and inside a model."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import SamplingParams, wrap_model
from promptcache.model_runtime.engine import Engine, EngineConfig
from promptcache.model_runtime.facade import ModelRuntime
from promptcache.model_runtime.loading.packed_linear import PackedLinear, can_pack, pack_linears
from promptcache.pml import token_plan
from tests.model_factories import make_test_tokenizer, make_tiny_model

needs_fp32 = pytest.mark.skipif(not can_pack(torch.float32), reason="oneDNN packing does not run on this CPU")
needs_bf16 = pytest.mark.skipif(not can_pack(torch.bfloat16), reason="no native bf16 packing on this CPU")


@needs_fp32
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1,), (9,), (2, 300)])
def test_packed_linear_equals_plain_in_fp32(bias, shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160, bias=bias)
    x = torch.randn(*shape, 96)
    with torch.inference_mode():
        got, expected = PackedLinear(linear)(x), linear(x)
    assert got.shape == expected.shape == (*shape, 160)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # only the summation order differs


@needs_bf16
def test_packed_linear_in_bf16_is_as_close_to_fp32_as_plain_bf16():
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 1536).to(torch.bfloat16)
    x = torch.randn(9, 576).to(torch.bfloat16)
    truth = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
    with torch.inference_mode():
        packed, plain = PackedLinear(linear)(x), linear(x)
    assert packed.dtype == torch.bfloat16
    # Both round one fp32-accumulated product to bf16: neither is further from fp32 than bf16's rounding.
    assert (packed.float() - truth).abs().max() <= (plain.float() - truth).abs().max() + 1e-2


@needs_fp32
def test_pack_linears_replaces_every_linear_and_keeps_the_tied_embedding():
    tokenizer = make_test_tokenizer()
    model = make_tiny_model("llama", vocab_size=len(tokenizer))
    reference = copy.deepcopy(model)
    num_linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    embedding = model.get_input_embeddings().weight
    assert pack_linears(model) == num_linears > 0
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert model.get_input_embeddings().weight is embedding  # the embedding keeps its own weight
    ids = torch.tensor([[5, 9, 42, 7, 300, 11]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_unsupported_dtypes_and_devices_are_left_plain(monkeypatch):
    tokenizer = make_test_tokenizer()
    half = make_tiny_model("llama", vocab_size=len(tokenizer), dtype=torch.float16)
    assert pack_linears(half) == 0 and not can_pack(torch.float16)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert not can_pack.__wrapped__(torch.float32)  # without oneDNN: the probe says no


@needs_fp32
def test_a_packed_model_fingerprints_and_generates_like_the_plain_one():
    tokenizer = make_test_tokenizer()
    plain = wrap_model(make_tiny_model("llama", vocab_size=len(tokenizer)), tokenizer, name="tiny")
    packed = wrap_model(make_tiny_model("llama", vocab_size=len(tokenizer)), tokenizer, name="tiny",
                        pack_weights=True)
    assert any(isinstance(m, PackedLinear) for m in packed.model.modules())
    assert packed.model_fingerprint == plain.model_fingerprint  # same weights, same KV keys
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = tuple(tokenizer.encode("The river flows north through the valley and", add_special_tokens=False))

    def engine_tokens(loaded) -> list[int]:
        runtime = ModelRuntime(loaded, build_store(StoreConfig(), device="cpu"))
        runtime.add_schema(runtime.parse_schema('<schema name="plain"/>'), encode=False)
        engine = Engine(runtime.module_encoder, EngineConfig())

        async def run() -> list[int]:
            plan = token_plan(runtime.get_schema("plain"), prompt)
            return [e.token_id async for e in engine.submit(plan, params) if e.token_id is not None]

        try:
            return asyncio.run(run())
        finally:
            engine.stop()

    assert engine_tokens(packed) == engine_tokens(plain)
