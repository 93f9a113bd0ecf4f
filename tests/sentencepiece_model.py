"""A SentencePiece tokenizer trained in-process (a tiny corpus, well under a second), shipped the way a
Llama-2/Mistral checkpoint ships it (`tokenizer.model`, loaded by transformers' LlamaTokenizer: dummy
prefix "▁", byte fallback, `<s>` BOS), with a tiny random-weight Llama model over its vocabulary."""

from __future__ import annotations

import functools
import io
import tempfile
from pathlib import Path

import torch

CORPUS = ("The river flows north through the valley. Cats sleep most of the day; tea is brewed hot.\n"
          "Rome wasn't built in a day, nor in a week. Where does the river flow? Who sleeps?\n"
          "Plan a trip of 3 days to Paris: museums, cafés and long walks by the water.\n") * 40


@functools.cache
def sentencepiece_dir() -> Path:
    """A directory holding `tokenizer.model` (trained once per test session)."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines()), model_writer=model, vocab_size=480, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    directory = Path(tempfile.mkdtemp(prefix="promptcache-sp-"))
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    return directory


@functools.cache
def sentencepiece_loaded():
    """(LoadedModel, tokenizer): a tiny Llama over the SentencePiece vocabulary, fp32."""
    from transformers import LlamaTokenizer

    from promptcache.model_runtime import wrap_model
    from tests.model_factories import make_tiny_model

    tokenizer = LlamaTokenizer.from_pretrained(str(sentencepiece_dir()), legacy=False, add_bos_token=True)
    torch.manual_seed(0)
    model = make_tiny_model("llama", vocab_size=len(tokenizer))
    return wrap_model(model, tokenizer, name="tiny-llama-sentencepiece"), tokenizer
