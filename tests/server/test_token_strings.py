"""The token-string table against the tokenizer decoding each id alone: the real SmolLM2 tokenizer over its
whole vocabulary (byte-level BPE), a SentencePiece-style one (Metaspace, byte fallback), ids past the
vocabulary, and one build however many threads ask at once."""

from __future__ import annotations

import threading

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from promptcache.server.token_strings import TokenStrings
from tests.model_factories import make_test_tokenizer


def _sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-style: '▁' marks a word start, bytes a piece lacks fall back to <0xNN> tokens, and decoding
    strips the space a sequence starts with (so '▁the' alone is 'the')."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "t", "h", "e", "a", "▁t", "▁th", "▁the", "▁a", "é"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("▁", "a")]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_the_table_is_each_id_decoded_alone_for_smollm2(smollm2):
    tokenizer = smollm2.tokenizer
    table = TokenStrings.of(tokenizer)
    expected = [tokenizer.decode([token_id]) for token_id in range(len(tokenizer))]
    assert len(expected) >= 49152
    assert list(table.build()) == expected
    assert [table.text(t) for t in (0, 1, 2, 504, len(tokenizer) - 1)] == [expected[t] for t in (0, 1, 2, 504, -1)]
    text = " The quick brown fox jumps over the lazy dog."  # ASCII: each byte-level token is its own text
    assert "".join(table.text(t) for t in tokenizer.encode(text, add_special_tokens=False)) == text


def test_the_table_is_each_id_decoded_alone_for_sentencepiece_and_test_tokenizers():
    for tokenizer in (_sentencepiece_tokenizer(), make_test_tokenizer()):
        table = TokenStrings.of(tokenizer)
        assert list(table.build()) == [tokenizer.decode([t]) for t in range(len(tokenizer))]
    sentencepiece = TokenStrings.of(_sentencepiece_tokenizer())
    vocab = _sentencepiece_tokenizer().get_vocab()
    assert sentencepiece.text(vocab["▁the"]) == "the" and sentencepiece.text(vocab["<0xE2>"]) == "\ufffd"


def test_ids_past_the_vocabulary_are_decoded_as_before():
    tokenizer = make_test_tokenizer()
    table = TokenStrings.of(tokenizer)
    assert table.text(len(tokenizer) + 7) == tokenizer.decode([len(tokenizer) + 7])


def test_concurrent_first_users_build_the_table_once():
    calls = []
    gate = threading.Barrier(8)

    def decode(ids: list[int]) -> str:
        calls.append(ids[0])
        return f"<{ids[0]}>"

    table = TokenStrings(decode, 1000)

    def first_use() -> None:
        gate.wait()
        assert table.text(999) == "<999>"

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(calls) == list(range(1000)) and table.is_built
