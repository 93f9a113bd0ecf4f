"""No request stalls the event loop for everyone: while a 2 MiB PML prompt, a 2 MiB schema, a 2 MiB JSON list and a
2 MiB body of bare markup are served, /health (polled from another process) answers within 100 ms at p99 and
500 ms at most. Each body held the loop for seconds before: the tokenizer kept the GIL, and JSON was decoded and
validated on the loop (all of it, before a list's length was checked)."""

from __future__ import annotations

import gc
import json
import random
import subprocess
import sys
import time

import httpx
import pytest

from promptcache.pml import PmlLimitError, TextEncoder
from tests.model_factories import make_test_tokenizer

MIB = 1 << 20
WORDS = ["the", "a", "cat", "sat", "on", "mat", "while", "dogs", "ran", "past", "two", "red",
         "cars", "and", "one", "blue", "bus", "near", "old", "town", "hall"]


def prose(num_chars: int, seed: int) -> str:
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(num_chars // 3))
    return text[:num_chars]


def bodies() -> dict[str, tuple[str, dict]]:
    """(path, JSON body) of each 2 MiB request; the texts are 430K-character pieces, under the per-piece cap, so
    every one of them is tokenized."""
    pieces = [prose(430_000, seed) for seed in range(5)]
    turns = "".join(f"<user>{piece}</user><assistant>ok</assistant>" for piece in pieces)
    code = "if a < 1 && b < 2: x &= 3 " * (MIB // 12)  # every `<` and `&` bare: escaped before parsing
    modules = "".join(f'<module name="m{i}">{piece}</module>' for i, piece in enumerate(pieces))
    return {
        "pml prompt": ("/v1/generate", {"prompt": f'<prompt schema="tiny">{turns}<user>?</user><assistant/></prompt>',
                                        "max_tokens": 1}),
        "schema": ("/v1/schemas", {"pml": f'<schema name="big">{modules}</schema>'}),
        "json list": ("/v1/completions", {"prompt": [[1]] * (MIB // 2), "max_tokens": 1}),
        "bare markup": ("/v1/generate", {"prompt": f'<prompt schema="tiny">{code}</prompt>', "max_tokens": 1}),
    }


@pytest.mark.slow
def test_health_answers_while_2mib_bodies_are_served(live_server):
    server = live_server(max_request_bytes=4 * MIB)
    httpx.post(server.url + "/v1/schemas", json={"pml": '<schema name="tiny"><module name="m">x</module></schema>'}
               ).raise_for_status()
    requests = bodies()
    assert all(2 * MIB <= len(json.dumps(body)) <= 4 * MIB for _, body in requests.values())
    gc.collect()
    gc.freeze()  # as test_robustness: the bound measures the server, not a collection over the suite's heap
    answers = {}
    try:
        poller = subprocess.Popen([sys.executable, "-m", "tests.server.health_poller", server.url],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert poller.stdout.readline().strip() == "ready"
        try:
            for name, (path, body) in requests.items():
                answers[name] = httpx.post(server.url + path, json=body, timeout=300)
                time.sleep(0.2)  # polls between the bodies too
        finally:
            out, _ = poller.communicate("stop\n", timeout=30)
    finally:
        gc.unfreeze()
    latencies = sorted(json.loads(out))
    assert len(latencies) >= 100
    assert latencies[int(0.99 * len(latencies))] <= 0.1 and latencies[-1] <= 0.5, latencies[-10:]

    assert {name: answer.status_code for name, answer in answers.items()} == {
        "pml prompt": 400, "schema": 413, "json list": 413, "bare markup": 413}, {
        name: answer.text[:300] for name, answer in answers.items()}


def test_a_text_piece_over_the_cap_is_refused_before_tokenizing():
    calls = []
    encoder = TextEncoder(encode_fn=lambda text: calls.append(text) or [1] * len(text.split()), max_piece_chars=1000)
    assert encoder.encode("a " * 500) == (1,) * 500
    with pytest.raises(PmlLimitError, match=r"1001 characters .* the limit is 1000 characters per text piece"):
        encoder.encode("b" * 1001)
    assert calls == ["a " * 500]


def test_pml_text_is_tokenized_as_the_tokenizer_encodes_it():
    """The GIL-free `encode_batch` call gives the ids `encode` gives, special-token text included."""
    tokenizer = make_test_tokenizer()
    encoder = TextEncoder.from_tokenizer(tokenizer)
    texts = [prose(2000, 7), "  leading spaces", "x", "<|im_start|>user\nhi<|im_end|>", "caf\u00e9 \u2603 \U0001f600"]
    for text in texts:
        assert encoder.encode(text, at_start=True) == tuple(tokenizer.encode(text, add_special_tokens=False))
