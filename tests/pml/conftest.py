"""Fixtures for PML tests: a real byte-level BPE tokenizer with a ChatML chat template."""

from __future__ import annotations

import pytest

from promptcache.pml import PmlLimits, PromptPlan, Schema, TextEncoder, parse_prompt, parse_schema
from tests.model_factories import make_test_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return make_test_tokenizer()


@pytest.fixture(scope="session")
def encoder(tokenizer) -> TextEncoder:
    return TextEncoder.from_tokenizer(tokenizer)


class Pml:
    """Parse schemas and prompts with the test encoder; `n(text)` is the oracle token count."""

    def __init__(self, encoder: TextEncoder) -> None:
        self.encoder = encoder
        self.schemas: dict[str, Schema] = {}

    def n(self, text: str) -> int:
        return len(self.encoder.encode(text))

    def schema(self, text: str, limits: PmlLimits | None = None) -> Schema:
        schema = parse_schema(text, self.encoder, limits)
        self.schemas[schema.name] = schema
        return schema

    def prompt(self, text: str, **kwargs) -> PromptPlan:
        return parse_prompt(text, self.schemas, self.encoder, **kwargs)


@pytest.fixture
def pml(encoder) -> Pml:
    return Pml(encoder)
