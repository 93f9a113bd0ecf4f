"""read_object against json.loads: whole bodies decode alike, and every cut of a body keeps the members before the
cut as json.loads reads them (random documents, every kind of value cut at every kind of place)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from promptcache.cluster.body_prefix import read_object

TEXT = 'ab"\\\n\u00e9\U0001f600/'  # quotes, escapes, control characters, two- and four-byte UTF-8


def _value(rng: random.Random, depth: int = 0) -> Any:
    kinds = [lambda: rng.randrange(-10**6, 10**6), lambda: rng.random() * 1e6, lambda: rng.choice([True, False, None]),
             lambda: "".join(rng.choice(TEXT) for _ in range(rng.randrange(6)))]
    if depth < 4:
        kinds += [lambda: [_value(rng, depth + 1) for _ in range(rng.randrange(4))],
                  lambda: {f"k{rng.randrange(9)}": _value(rng, depth + 1) for _ in range(rng.randrange(4))}]
    return rng.choice(kinds)()


def _bodies(n: int) -> list[tuple[dict, bytes]]:
    rng = random.Random(0)
    documents = [{f"m{i}": _value(rng) for i in range(rng.randrange(1, 5))} for _ in range(n)]
    return [(d, json.dumps(d, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1])).encode())
            for d in documents]


def test_a_whole_body_reads_as_json_loads_reads_it():
    for document, body in _bodies(500):
        assert read_object(body, len(body)) == document


def test_a_cut_body_keeps_each_member_before_the_cut_whole():
    rng = random.Random(1)
    for document, body in _bodies(500):
        for max_bytes in {1, rng.randrange(1, len(body)), rng.randrange(1, len(body)), len(body) - 1} - {0}:
            read = read_object(body, max_bytes)
            assert isinstance(read, dict), (body[:max_bytes], read)
            assert set(read) <= set(document)
            members = list(read)
            assert all(read[name] == document[name] for name in members[:-1]), (body[:max_bytes], read)


def test_a_string_the_prefix_cuts_is_its_start():
    body = json.dumps({"model": "m", "prompt": "\u00e9" + "x\\\"y" * 100}).encode()
    for max_bytes in range(len(b'{"model": "m", "prompt": "'), len(body)):
        prompt = read_object(body, max_bytes)["prompt"]
        assert ("\u00e9" + "x\\\"y" * 100).startswith(prompt)
        assert len(json.dumps(prompt)) - 2 >= max_bytes - len(b'{"model": "m", "prompt": "') - 6  # all but an escape


@pytest.mark.parametrize("body", [b"[1, 2]", b'{"a": 1} x', b'{"a": tru}', b'{"a": 01}', b"\xff{}", b'{"a": "\x01"}',
                                  b'{"a": [}', b"", b'"text"'])
def test_what_is_no_json_object_reads_as_none(body):
    assert read_object(body, 1 << 20) is None


@pytest.mark.parametrize("body", [b'{"a": [}' + b" " * 100, b"[" * 1000, b'{"a": ' + b"[" * 1000, b"\xff" * 1000])
def test_a_prefix_that_is_no_json_object_start_reads_as_none(body):
    assert read_object(body, 500) is None
