"""Host cost per generated token of streaming text (Detokenizer.push, then flush), at 16 and 4,096 tokens, with the
API's most stop strings (8 x 256 characters) that never match, over the default model's (SmolLM2's) tokenizer.

    python -m benchmarks.engine.detokenize --runs 7

`window` is promptcache's Detokenizer; `full_decode` (a baseline, the algorithm it replaced) decodes every id
generated so far at each token and tries every prefix of every stop string. The same 4,096 tokens are streamed as
one output or as 256 outputs of 16 (content changes the cost per token too). The target: `window` at 4,096 tokens
within 1.2x of its cost at 16. Configurations interleave within each run; medians over the runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from benchmarks.harness import RESULTS, emit, log
from promptcache.model_runtime.detokenizer import Detokenizer
from promptcache.model_runtime.loading.default_model import default_model_path

WORDS = ("the", "river", "flows", "north", "through", "valley", "and", "old", "mill", "turns", "beside", "it", "cats",
         "sleep", "most", "of", "day", "tea", "is", "brewed", "hot", "in", "morning", "café", "naïve", "déjà", "vu",
         "日本", "😀", "3.14", "(a)", "[b]", "{c}")


class FullDecodeDetokenizer:
    """The baseline: the whole output decoded at every token, each stop string's every prefix tried against the
    text's end (the Detokenizer before its window)."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.token_ids: list[int] = []
        self.text, self.num_emitted, self.is_stopped = "", 0, False

    def push(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        for stop in self.stop:
            at = text.find(stop, max(0, self.num_emitted - len(stop)))
            if at != -1:
                text, self.is_stopped = text[:at], True
        self.text = text
        safe = len(text) if self.is_stopped else len(text.rstrip("\ufffd"))
        for stop in () if self.is_stopped else self.stop:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    safe = min(safe, len(text) - k)
                    break
        return self._emit(safe)

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        delta = self.text[self.num_emitted:upto]
        self.num_emitted = max(self.num_emitted, upto)
        return delta


def generated_ids(tokenizer, num_tokens: int, seed: int = 0) -> list[int]:
    """`num_tokens` ids of seeded word salad (multi-byte characters split across tokens included)."""
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(num_tokens))
    ids = tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    assert len(ids) == num_tokens
    return ids


def stop_strings(num_stops: int, num_chars: int, seed: int = 1) -> list[str]:
    """Stop strings made of the text's words (so their prefixes match often and text is held back) that end in
    a character the text never has: they never match."""
    rng = random.Random(seed)
    stops = []
    for _ in range(num_stops):
        words = " " + " ".join(rng.choice(WORDS) for _ in range(num_chars))
        stops.append(words[:num_chars - 1] + "§")
    return stops


def us_per_token(kind, tokenizer, outputs: list[list[int]], stops: list[str], repeats: int) -> tuple[float, float]:
    """Stream each output (a fresh detokenizer each), `repeats` times; (CPU, wall) microseconds per token."""
    cpu_started, started = time.process_time(), time.perf_counter()
    for _ in range(repeats):
        for ids in outputs:
            detokenizer = kind(tokenizer, stops)
            for token_id in ids:
                detokenizer.push(token_id)
            detokenizer.flush()
            assert not detokenizer.is_stopped
    num_tokens = repeats * sum(map(len, outputs))
    return ((time.process_time() - cpu_started) * 1e6 / num_tokens, (time.perf_counter() - started) * 1e6 / num_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", nargs="+", type=int, default=[16, 4096])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--stops", type=int, default=8)
    parser.add_argument("--stop-chars", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=4, help="passes over the tokens per `window` sample")
    parser.add_argument("--baseline-runs", type=int, default=1, help="full_decode runs (4,096 tokens: seconds each)")
    parser.add_argument("--out", type=Path, default=RESULTS / "detokenize.jsonl")
    args = parser.parse_args()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(default_model_path()))
    stops = stop_strings(args.stops, args.stop_chars)
    kinds = {"window": Detokenizer, "full_decode": FullDecodeDetokenizer}
    stream = generated_ids(tokenizer, max(args.tokens))
    configs = [(kind, n) for kind in kinds for n in args.tokens]
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {config: [] for config in configs}
    for run in range(max(args.runs, args.baseline_runs)):
        sampled = [(kind, n) for kind, n in configs if run < (args.runs if kind == "window" else args.baseline_runs)]
        for kind, n in sampled:
            outputs = [stream[start:start + n] for start in range(0, len(stream), n)]
            repeats = args.repeats if kind == "window" else 1
            us_per_token(kinds[kind], tokenizer, outputs[:1], stops, 1)  # warm-up
            samples[kind, n].append(us_per_token(kinds[kind], tokenizer, outputs, stops, repeats))
        log(f"run {run + 1}: " + ", ".join(f"{k} {n}: {samples[k, n][-1][0]:.1f} us" for k, n in sampled))
    # CPU time is the host cost; wall time also counts the waits of a machine shared with other work.
    cpu = {config: statistics.median(v[0] for v in values) for config, values in samples.items()}
    wall = {config: statistics.median(v[1] for v in values) for config, values in samples.items()}
    for (kind, n), values in samples.items():
        emit({"bench": "detokenize", "tokenizer": "SmolLM2-135M-Instruct", "algorithm": kind,
              "generated_tokens": n, "num_stops": args.stops, "stop_chars": args.stop_chars,
              "median_cpu_us_per_token": round(cpu[kind, n], 2), "median_wall_us_per_token": round(wall[kind, n], 2),
              "runs_cpu_us_per_token": [round(v[0], 2) for v in values]}, args.out)
    short, long = min(args.tokens), max(args.tokens)
    for kind in kinds:
        emit({"bench": "detokenize", "algorithm": kind, "ratio": f"{long}/{short} tokens",
              "cpu_cost_per_token_ratio": round(cpu[kind, long] / cpu[kind, short], 3),
              "wall_cost_per_token_ratio": round(wall[kind, long] / wall[kind, short], 3)}, args.out)


if __name__ == "__main__":
    main()
