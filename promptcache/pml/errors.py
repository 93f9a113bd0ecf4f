"""The PML error tree: every user-facing failure of schema or prompt parsing."""

from __future__ import annotations


class PmlError(Exception):
    """Root of every PML error. The message names the element, its line, and what was expected."""

    def __init__(self, message: str, *, line: int | None = None) -> None:
        self.line = line
        super().__init__(f"line {line}: {message}" if line is not None else message)


class PmlSyntaxError(PmlError):
    """The text is not well-formed XML (raw `<`, unclosed tags, ...)."""


class PmlSecurityError(PmlError):
    """The document uses a forbidden XML feature (DTD, entities, processing instructions)."""


class PmlLimitError(PmlError):
    """The document exceeds a configured size limit (bytes, depth, modules, tokens)."""


class SchemaError(PmlError):
    """The schema is well-formed XML but not a valid PML schema."""


class InvalidNameError(SchemaError):
    """A name is malformed, reserved, or declared twice in one scope."""


class InvalidParamError(SchemaError):
    """A `<param>` declaration is malformed (missing name, bad length, misplaced)."""


class ScaffoldError(SchemaError):
    """A `<scaffold>` names unknown modules or modules whose tokens share positions."""


class ChatTemplateError(SchemaError):
    """The tokenizer's chat template cannot be split into per-role prefixes and suffixes, or cannot express the role
    layout written (under a template that folds the system text into the first user turn: FOLDED_SYSTEM)."""


FOLDED_SYSTEM = "this model's chat template writes the system text into the first user turn"


class PromptError(PmlError):
    """The prompt is well-formed XML but does not fit its schema."""


class UnknownSchemaError(PromptError):
    """The prompt names a schema that is not loaded (`schema_name` says which)."""

    def __init__(self, message: str, *, line: int | None = None, schema_name: str = "") -> None:
        super().__init__(message, line=line)
        self.schema_name = schema_name


class UnknownModuleError(PromptError):
    """The prompt imports a module the schema does not declare at that nesting level."""


class UnknownParamError(PromptError):
    """The prompt passes an argument the imported module does not declare."""


class DuplicateImportError(PromptError):
    """A module is imported twice, or two members of one union are imported."""


class ArgumentTooLongError(PromptError):
    """An argument has more tokens than its parameter reserves."""


class PositionConflictError(PromptError):
    """New text does not fit in the free positions where it must go."""


class EmptyPromptError(PromptError):
    """The prompt includes no token at all."""
