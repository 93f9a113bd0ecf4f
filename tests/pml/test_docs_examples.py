"""Every XML example in docs/pml.md parses: schemas first, then each prompt against them."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "pml.md"


def test_docs_examples_parse(pml):
    blocks = re.findall(r"```xml\n(.*?)```", DOC.read_text(), flags=re.S)
    schemas = [b for b in blocks if b.lstrip().startswith("<schema")]
    prompts = [b for b in blocks if b.lstrip().startswith("<prompt")]
    assert len(schemas) >= 3 and len(prompts) >= 3
    for block in schemas:
        pml.schema(block)
    for block in prompts:
        plan = pml.prompt(block)
        assert plan.num_prompt_tokens > 0 and plan.module_paths
