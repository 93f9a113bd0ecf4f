"""Layouts of the example schemas in tests/pml/golden/*.pml against reviewed golden JSON files.

Regenerate after an intended layout change with `python -m tests.pml.test_golden_layouts`, then
review the diff: each segment lists its decoded text, positions and encoding context.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from promptcache.pml import Schema, TextEncoder, parse_schema
from tests.model_factories import make_test_tokenizer

GOLDEN = Path(__file__).parent / "golden"


def layout(schema: Schema, tokenizer) -> dict:
    return {
        "schema": schema.name,
        "num_positions": schema.num_positions,
        "modules": schema.module_table(),
        "segments": [
            {"id": s.segment_id, "owner": s.owner, "start": s.start, "end": s.end, "context": list(s.context_ids),
             "cached": s.is_cached, "placeholder": s.is_placeholder,
             "text": tokenizer.decode(s.token_ids)}
            for s in schema.segments
        ],
        "scaffolds": [{"name": sc.name, "modules": list(sc.module_paths),
                       "contexts": {str(k): list(v) for k, v in sc.contexts.items()}} for sc in schema.scaffolds],
    }


@pytest.mark.parametrize("source", sorted(GOLDEN.glob("*.pml")), ids=lambda p: p.stem)
def test_layout_matches_golden(source, tokenizer, encoder):
    schema = parse_schema(source.read_text(), encoder)
    expected = json.loads(source.with_suffix(".json").read_text())
    assert layout(schema, tokenizer) == expected


def test_golden_files_exist():
    assert len(list(GOLDEN.glob("*.pml"))) >= 3


if __name__ == "__main__":
    tokenizer = make_test_tokenizer()
    encoder = TextEncoder.from_tokenizer(tokenizer)
    for path in sorted(GOLDEN.glob("*.pml")):
        data = layout(parse_schema(path.read_text(), encoder), tokenizer)
        path.with_suffix(".json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        print("wrote", path.with_suffix(".json"))
