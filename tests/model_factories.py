"""In-process models and tokenizer for tests: a real byte-level BPE tokenizer with a ChatML template,
and tiny random-weight Llama / Mistral / Qwen2 / Qwen3 / Phi-3 / GPT-2 models built from HF configs (no downloads)."""

from __future__ import annotations

import functools

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from promptcache.model_runtime.loading.loader import LoadedModel, wrap_model

# The golden PML layouts (tests/pml/golden) are token counts under this tokenizer: changing CORPUS,
# the vocab size or the special tokens means regenerating and reviewing them.
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
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2")


@functools.lru_cache(maxsize=1)
def make_test_tokenizer() -> PreTrainedTokenizerFast:
    """Deterministic byte-level BPE trained on CORPUS (521 tokens: the corpus runs out of merges before
    the 600 asked for), special tokens and ChatML template like SmolLM2. Shared: copy before mutating
    (`make_test_tokenizer.__wrapped__()` builds a fresh one)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # The initial alphabet holds all 256 byte symbols, so any text encodes without unknowns.
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([CORPUS] * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    return tokenizer


def tiny_config(arch: str, *, vocab_size: int, hidden_size: int = 64) -> PretrainedConfig:
    """Config of a tiny `arch` model: 2 layers, 4 heads (2 KV heads for the RoPE archs; Qwen3's heads twice as wide
    as hidden / heads, as its real models' are wider), an MLP twice as wide as `hidden_size` (64; 256 gives heads of
    64, shapes the bf16 kernels take)."""
    # initializer_range 0.1 (HF default 0.02) spreads the logits, so greedy argmax is never a near-tie.
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  initializer_range=0.1)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)  # q/k/v biases are Qwen2's built-in default
    if arch == "qwen3":  # q/k RMSNorm per head before RoPE
        return Qwen3Config(**common, head_dim=hidden_size // 2, use_sliding_window=False)
    if arch == "phi3":  # joined qkv_proj and gate_up_proj; its default ids (32000) lie outside a tiny vocabulary
        return Phi3Config(**common, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_embd=hidden_size, n_inner=2 * hidden_size, n_layer=2, n_head=4,
                          n_positions=2048, initializer_range=0.1, bos_token_id=None, eos_token_id=None)
    raise ValueError(f"no tiny model for {arch!r}; choose one of {ARCHITECTURES}")


def make_tiny_model(arch: str, *, vocab_size: int, seed: int = 0,
                    dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A random-weight `arch` model (see `tiny_config`), SDPA attention, eval mode; same seed, same weights:
    drawn in fp32 and then cast, so a bf16 model holds the fp32 model's weights rounded (a bf16 draw gives
    other weights on some torch versions)."""
    config = tiny_config(arch, vocab_size=vocab_size)
    with torch.random.fork_rng(devices=[]):  # seed locally: the caller's RNG stream is left alone
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.to(dtype).eval()


def make_tiny_loaded(arch: str, *, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """`make_tiny_model(arch)` over the test tokenizer, wrapped as `tiny-{arch}`."""
    tokenizer = make_test_tokenizer()
    return wrap_model(make_tiny_model(arch, vocab_size=len(tokenizer), dtype=dtype), tokenizer, name=f"tiny-{arch}")
