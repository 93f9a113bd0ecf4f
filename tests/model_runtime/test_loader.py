"""Model loading: supported architectures, refusal before weights, fingerprints, the default model."""

from __future__ import annotations

import json
import time

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from promptcache.model_runtime import (
    ModelConfig,
    ModelLoadError,
    UnsupportedModelError,
    load_model,
    wrap_model,
)
from promptcache.model_runtime.default_model import default_model_path
from tests.model_factories import make_test_tokenizer, make_tiny_model


@pytest.mark.parametrize(("arch", "kv_heads", "rope"), [("llama", 2, True), ("mistral", 2, True), ("qwen2", 2, True),
                                                         ("gpt2", 4, False)])
def test_wrap_describes_each_architecture(arch, kv_heads, rope):
    tokenizer = make_test_tokenizer()
    loaded = wrap_model(make_tiny_model(arch, vocab_size=len(tokenizer)), tokenizer, name=arch)
    assert (loaded.architecture, loaded.num_layers, loaded.num_heads, loaded.num_kv_heads, loaded.head_dim,
            loaded.uses_rope) == (arch, 2, 4, kv_heads, 16, rope)


def test_load_from_disk_matches_in_memory(tmp_path):
    tokenizer = make_test_tokenizer()
    model = make_tiny_model("qwen2", vocab_size=len(tokenizer))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(ModelConfig(str(tmp_path)))
    ids = torch.tensor([[5, 9, 42, 7]])
    with torch.inference_mode():
        assert torch.equal(loaded.model(ids).logits, model(ids).logits)
    assert loaded.model_fingerprint == load_model(ModelConfig(str(tmp_path))).model_fingerprint
    half = load_model(ModelConfig(str(tmp_path), dtype="bfloat16"))
    assert half.model.dtype == torch.bfloat16 and half.model_fingerprint != loaded.model_fingerprint
    assert load_model(ModelConfig(str(tmp_path), dtype="float16")).model.dtype == torch.float16


def test_unsupported_architecture_refused_before_weights(tmp_path):
    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64)).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not weights")  # never read
    with pytest.raises(UnsupportedModelError, match="gpt_neox"):
        load_model(ModelConfig(str(tmp_path)))


def test_missing_path_and_bad_config():
    with pytest.raises(ModelLoadError, match="/nonexistent"):
        load_model(ModelConfig("/nonexistent/model"))
    with pytest.raises(ValueError):
        ModelConfig(dtype="int8")


def test_sliding_window_refused(tmp_path):
    tokenizer = make_test_tokenizer()
    model = make_tiny_model("mistral", vocab_size=len(tokenizer))
    model.config.sliding_window = 16
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["sliding_window"] == 16
    with pytest.raises(UnsupportedModelError, match="sliding"):
        load_model(ModelConfig(str(tmp_path)))


def test_fingerprints_follow_the_tokenizer_and_template():
    tokenizer = make_test_tokenizer()
    model = make_tiny_model("llama", vocab_size=len(tokenizer))
    a = wrap_model(model, tokenizer, name="x")
    other = make_test_tokenizer.__wrapped__()
    other.chat_template = "{{ messages[0]['content'] }}"
    b = wrap_model(model, other, name="x")
    assert a.tokenizer_fingerprint != b.tokenizer_fingerprint and a.model_fingerprint == b.model_fingerprint
    assert wrap_model(model, tokenizer, name="y").model_fingerprint != a.model_fingerprint


def test_default_model_is_smollm2(smollm2):
    assert (smollm2.architecture, smollm2.num_layers, smollm2.num_heads, smollm2.num_kv_heads, smollm2.head_dim) \
        == ("llama", 30, 9, 3, 64)
    assert "<|im_start|>" in smollm2.tokenizer.chat_template
    assert smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>") in smollm2.eos_token_ids
    started = time.perf_counter()
    path = default_model_path()  # converted once: later calls only find the directory
    assert (path / "model.safetensors").is_file() and time.perf_counter() - started < 1.0
