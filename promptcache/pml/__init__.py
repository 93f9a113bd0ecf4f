"""PML: Prompt Markup Language schemas and prompts -> typed trees, position layouts and plans (pure Python +
lxml, no torch): parse_schema, parse_prompt, Schema/PromptPlan, TextEncoder, PmlLimits, the PmlError tree."""

from promptcache.pml.chat_format import PLAIN_CHAT_FORMAT, ChatFormat, chat_format_from_tokenizer
from promptcache.pml.errors import (
    ArgumentTooLongError,
    ChatTemplateError,
    DuplicateImportError,
    EmptyPromptError,
    InvalidNameError,
    InvalidParamError,
    PmlError,
    PmlLimitError,
    PmlSecurityError,
    PmlSyntaxError,
    PositionConflictError,
    PromptError,
    ScaffoldError,
    SchemaError,
    UnknownModuleError,
    UnknownParamError,
    UnknownSchemaError,
)
from promptcache.pml.plan import CachedSegment, NewRun, PromptPlan, token_plan
from promptcache.pml.prompt_parser import parse_prompt
from promptcache.pml.schema import Module, Param, RoleSection, Scaffold, Schema, Segment, TextRun, Union, is_valid_name
from promptcache.pml.schema_parser import parse_schema
from promptcache.pml.text_encoder import TextEncoder
from promptcache.pml.xml_reader import PmlLimits

__all__ = ["PLAIN_CHAT_FORMAT", "ArgumentTooLongError", "CachedSegment", "ChatFormat", "ChatTemplateError",
           "DuplicateImportError", "EmptyPromptError", "InvalidNameError", "InvalidParamError", "Module", "NewRun",
           "Param", "PmlError", "PmlLimitError", "PmlLimits", "PmlSecurityError", "PmlSyntaxError",
           "PositionConflictError", "PromptError", "PromptPlan", "RoleSection", "Scaffold", "ScaffoldError", "Schema",
           "SchemaError", "Segment", "TextEncoder", "TextRun", "Union", "UnknownModuleError", "UnknownParamError",
           "UnknownSchemaError", "chat_format_from_tokenizer", "is_valid_name", "parse_prompt", "parse_schema",
           "token_plan"]
