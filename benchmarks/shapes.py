"""Realistic model shapes with random weights, and a tokenizer built in process, for timing (timing does not
depend on weights)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

SHAPES = {
    # TinyLlama-1.1B: 22 layers, hidden 2048, 32 query / 4 KV heads, MLP 5632.
    "tinyllama-1.1b": lambda vocab: LlamaConfig(
        vocab_size=vocab, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=16384, rope_theta=10000.0),
    # Qwen2.5-0.5B: 24 layers, hidden 896, 14 query / 2 KV heads, MLP 4864, QKV biases.
    "qwen2.5-0.5b": lambda vocab: Qwen2Config(
        vocab_size=vocab, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
        tie_word_embeddings=True, use_sliding_window=False),
}
# The shapes' real vocabularies: the LM head's size is part of the cost being timed.
VOCAB = {"tinyllama-1.1b": 32000, "qwen2.5-0.5b": 151936}
# SmolLM2's special tokens and ChatML template, for byte_tokenizer.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def build_model(shape: str, *, min_vocab: int = 0, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A random-weight model of `shape` (fp32 by default), eval mode, SDPA attention.

    The vocabulary grows to `min_vocab` when the tokenizer used needs more ids than the shape has
    (TinyLlama's 32000 < SmolLM2's 49152): with `logits_to_keep=1` that adds one LM-head row block.
    """
    torch.manual_seed(seed)
    config = SHAPES[shape](max(VOCAB[shape], min_vocab))
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte plus SmolLM2's special tokens and ChatML template, built in process: for a
    machine without the default model's files (the GPU check). Timing depends on token counts only."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={symbol: i for i, symbol in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    return tokenizer


def save_model(shape: str, directory: str) -> None:
    """Write a random-weight `shape` model with SmolLM2's tokenizer to `directory`, for `promptcache serve
    --model DIR` (timing over HTTP at a larger shape than the built-in model)."""
    from transformers import AutoTokenizer

    from promptcache.model_runtime.loading.default_model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    build_model(shape, min_vocab=len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="python -m benchmarks.shapes SHAPE DIR: save a random-weight model")
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("directory")
    args = parser.parse_args()
    save_model(args.shape, args.directory)
