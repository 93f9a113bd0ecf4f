"""In-process models and tokenizer for tests: a real byte-level BPE tokenizer with a ChatML template,
and tiny random-weight Llama / Mistral / Qwen2 / GPT-2 models built from HF configs (no downloads)."""

from __future__ import annotations

import functools

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from promptcache.model_runtime import LoadedModel, wrap_model

CORPUS = """The quick brown fox jumps over the lazy dog. Plan a trip of three days to Miami or Paris.
Cats sleep most of the day, and tea is brewed with hot water. Rome was not built in a day.
The river flows north through the valley; the moon orbits the earth every month. Bees make honey.
Answer the question using only the documents. What is the capital of France? It is Paris.
You are a helpful assistant. Summarise the report in one sentence. The committee met on Monday.
def add(a, b): return a + b  # code, numbers 0123456789 and symbols <>&"' are bytes too.
"""
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@functools.lru_cache(maxsize=1)
def make_test_tokenizer() -> PreTrainedTokenizerFast:
    """Deterministic byte-level BPE (vocab 600) trained on CORPUS; ChatML like SmolLM2."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([CORPUS] * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    return tokenizer


def make_tiny_model(arch: str, *, vocab_size: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A 2-layer random model of `arch` (GQA 4:2 for RoPE archs); weights scaled so logits are spread."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.1)
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "mistral":
        config = MistralConfig(**common, sliding_window=None)
    elif arch == "qwen2":
        config = Qwen2Config(**common, use_sliding_window=False)
    elif arch == "gpt2":
        config = GPT2Config(vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=1024,
                            initializer_range=0.1, bos_token_id=None, eos_token_id=None)
    else:
        raise ValueError(f"no tiny model for {arch!r}")
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def make_tiny_loaded(arch: str, *, dtype: torch.dtype = torch.float32) -> LoadedModel:
    tokenizer = make_test_tokenizer()
    return wrap_model(make_tiny_model(arch, vocab_size=len(tokenizer), dtype=dtype), tokenizer, name=f"tiny-{arch}")
