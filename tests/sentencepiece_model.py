"""A SentencePiece checkpoint built in-process: a BPE `tokenizer.model` trained on a small corpus with
Llama-2's trainer settings (byte fallback, identity normalization, whitespace kept, split digits,
dummy "▁" prefix; well under a second), saved with a tiny random-weight Llama the way Llama-2 and
Mistral checkpoints ship, and loaded through promptcache's own `load_model`.

Three tokenizer setups, all from the same `tokenizer.model`:
- "llama": `LlamaTokenizer`, `legacy: false` (Llama-2-hf's tokenizer_config today): transformers
  prepends "▁" at the start of the text only (Metaspace, prepend_scheme "first").
- "llama-legacy": `LlamaTokenizer`, `legacy: true` (older configs): "▁" after every special token too.
- "tokenizer-json": the slow-to-fast conversion's `tokenizer.json` (Prepend("▁") + Replace(" ", "▁")
  normalizer, as Llama-2/Mistral ship it), declared `PreTrainedTokenizerFast` so it loads verbatim;
  it tokenizes exactly as SentencePiece does.

`sentencepiece_processor()` is SentencePiece itself, the oracle; with `dummy_prefix=False` it
tokenizes a text as it tokenizes after other text (no "▁" added in front).
"""

from __future__ import annotations

import atexit
import functools
import io
import json
import shutil
import tempfile
from pathlib import Path

TOKENIZER_KINDS = ("llama", "llama-legacy", "tokenizer-json")

# About 5 KB. No "€", "日" or "本" anywhere: those encode through byte fallback.
CORPUS = """The river flows north through the valley, and the old mill turns beside it.
Cats sleep most of the day; tea is brewed hot in the morning, then served with honey.
Rome wasn't built in a day, nor in a week. Where does the river flow? Who sleeps all day?
Plan a trip of 3 days to Paris: museums, cafés and long walks by the water.
Answer the question using only the documents below.  Two spaces here, and a tab\there.
    An indented line with four spaces, like code or a quotation.
Numbers: 12345, 2024-06-01; symbols: (a) [b] {c} "quoted" 'single' - dash / slash.
Naïve façade, déjà vu, über, crème brûlée, señor, smörgåsbord.
You are a helpful assistant. Summarise the report in one sentence, then answer.
"""


@functools.cache
def sentencepiece_model() -> bytes:
    """The serialized `tokenizer.model` (trained once per process)."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines() * 12), model_writer=model, model_type="bpe", vocab_size=600,
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
        allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
    return model.getvalue()


@functools.cache
def sentencepiece_processor(*, dummy_prefix: bool = True):
    """SentencePiece over the trained model; `dummy_prefix=False` leaves out the leading "▁"."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(sentencepiece_model())
    proto.normalizer_spec.add_dummy_prefix = dummy_prefix
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


@functools.cache
def sentencepiece_checkpoint(kind: str = "llama") -> Path:
    """A model directory (config, safetensors weights, tokenizer.model, tokenizer.json,
    tokenizer_config.json) with a tiny random-weight Llama over the SentencePiece vocabulary."""
    from transformers import LlamaTokenizer, PreTrainedTokenizerFast

    from tests.model_factories import make_tiny_model

    if kind not in TOKENIZER_KINDS:
        raise ValueError(f"no SentencePiece tokenizer kind {kind!r}; choose one of {TOKENIZER_KINDS}")
    directory = Path(tempfile.mkdtemp(prefix=f"promptcache-sp-{kind}-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    (directory / "tokenizer.model").write_bytes(sentencepiece_model())
    special = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if kind == "tokenizer-json":
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=_converted(directory), **special)
    else:
        # transformers builds the fast tokenizer from tokenizer.model; `add_bos_token` puts `<s>` in the
        # saved tokenizer.json's post-processor, where transformers 5 reads it from.
        tokenizer = LlamaTokenizer.from_pretrained(str(directory), legacy=kind == "llama-legacy",
                                                   add_bos_token=True, **special)
    tokenizer.save_pretrained(directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(add_bos_token=True, add_eos_token=False)
    if kind == "tokenizer-json":
        config.update(tokenizer_class="PreTrainedTokenizerFast")  # as transformers 4 wrote it
    else:
        config.update(tokenizer_class="LlamaTokenizer", legacy=kind == "llama-legacy")
    config_path.write_text(json.dumps(config, indent=1))
    make_tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(directory)
    return directory


def _converted(directory: Path):
    """`tokenizer.model` converted to the tokenizer.json Llama-2 ships: the vocabulary and merges
    transformers extracts, with the normalizer its LlamaConverter writes for `legacy` tokenizers
    (Prepend("▁"), Replace(" ", "▁"); no pre-tokenizer) and `<s>` prepended by the post-processor."""
    from tokenizers import Tokenizer, normalizers, processors
    from transformers import LlamaTokenizer

    extracted = json.loads(LlamaTokenizer.from_pretrained(str(directory)).backend_tokenizer.to_str())
    extracted["pre_tokenizer"] = None
    backend = Tokenizer.from_str(json.dumps(extracted))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    return backend


@functools.cache
def sentencepiece_loaded(kind: str = "llama"):
    """The checkpoint of `kind` loaded by `load_model` (fp32, CPU), as `promptcache serve` loads it."""
    from promptcache.model_runtime import ModelConfig, load_model

    return load_model(ModelConfig(name_or_path=str(sentencepiece_checkpoint(kind))))
