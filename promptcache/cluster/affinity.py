"""Affinity keys: what a request's reusable KV depends on, read from the HTTP request without tokenizing.
Requests with the same key would reuse the same cached KV, so the router sends them to the same replica (the
keys by route are tabled in docs/scaling.md). The tenant comes from the API key through the replicas'
TenantDirectory, never from the body; an unknown key gets no key. Keys are digests: no prompt text is kept. The body
is read only as far as its first `max_body_bytes` (body_prefix.py): a field after them is absent, so a request
whose schema is named past them is routed by load alone."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from promptcache.cluster.body_prefix import read_object
from promptcache.cluster.errors import ClusterConfigError
from promptcache.cluster.forwarded import ForwardedRequest
from promptcache.pml.schema import RESERVED_NAMES

if TYPE_CHECKING:  # the server package imports the model runtime: the simulator does without it
    from promptcache.server.tenants import TenantDirectory

KeyKind = Literal["pml", "prefix", "schema"]
PML_ROUTES = frozenset({"/v1/generate", "/v1/prompts/explain"})
# Linear in the text: OPEN_TAG's matches start at a literal `<` and never overlap; ATTRIBUTE is only
# matched anchored, one attribute after the other. A search like r"<prompt\b[^>]*?\bschema=" is not:
# each of many `<prompt` openings without a `>` rescans the rest of the text (_start_tag_attribute).
OPEN_TAG = re.compile(r"<([A-Za-z_][A-Za-z0-9_.-]*)")  # closing tags, comments, CDATA never match
ATTRIBUTE = re.compile(r"""\s+([^\s=/>"']+)\s*=\s*(?:"([^"]*)"|'([^']*)')""")


@dataclass(frozen=True, slots=True)
class AffinityConfig:
    """How much of a request the key looks at."""

    prefix_chars: int = 256  # plain/chat text hashed: about two prefix blocks of 32 tokens
    max_body_bytes: int = 64 << 10  # of a body the router reads this much: a 2 MiB body costs what 64 KiB do
    max_scan_chars: int = 256 << 10  # tags and their names are looked for in at most this much PML
    pml_key: Literal["modules", "schema"] = "modules"  # what of a PML prompt the key covers

    def __post_init__(self) -> None:
        if self.pml_key not in ("modules", "schema"):
            raise ClusterConfigError(f"pml_key must be 'modules' or 'schema', got {self.pml_key!r}")
        if self.prefix_chars < 1:
            raise ClusterConfigError(f"prefix_chars must be at least 1, got {self.prefix_chars}")
        if self.max_body_bytes < 1:
            raise ClusterConfigError(f"max_body_bytes must be at least 1, got {self.max_body_bytes}")
        if self.max_scan_chars < 1:
            raise ClusterConfigError(f"max_scan_chars must be at least 1, got {self.max_scan_chars}")


@dataclass(frozen=True, slots=True)
class AffinityKey:
    kind: KeyKind
    digest: bytes  # 16 bytes


def affinity_key(request: ForwardedRequest, tenants: TenantDirectory,
                 config: AffinityConfig = AffinityConfig()) -> AffinityKey | None:
    """The request's affinity key, or None when it has none (any replica serves it as well as another)."""
    from promptcache.server.errors import UnauthorizedError

    if request.method != "POST":
        return None
    try:
        owner = tenants.authenticate(request.header("authorization")) or ""
    except UnauthorizedError:
        return None
    if (body := read_object(request.body, config.max_body_bytes)) is None:
        return None
    salt = body["cache_salt"] if isinstance(body.get("cache_salt"), str) else ""
    if request.path == "/v1/schemas":
        name = _start_tag_attribute(body.get("pml"), "schema", "name", config)
        return None if name is None else _key("schema", owner, name)
    if request.path in PML_ROUTES:
        return _prompt_key(owner, body.get("prompt"), config)
    if request.path == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # several prompts: the first one decides
        if isinstance(prompt, str) and prompt.lstrip().startswith("<prompt"):
            return _prompt_key(owner, prompt, config)
        if isinstance(prompt, str) and prompt:
            return _key("prefix", owner, salt, "text", prompt[:config.prefix_chars])
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return _key("prefix", owner, salt, "ids", ",".join(map(str, prompt[:config.prefix_chars // 4])))
        return None
    if request.path == "/v1/chat/completions":
        return _chat_key(owner, salt, body, config)
    return None


def _prompt_key(owner: str, prompt: Any, config: AffinityConfig) -> AffinityKey | None:
    schema = _start_tag_attribute(prompt, "prompt", "schema", config)
    return None if schema is None else _pml_key(owner, schema, prompt, config)


def _pml_key(owner: str, schema: str, pml: str, config: AffinityConfig) -> AffinityKey:
    """(tenant, schema), with `pml_key="modules"` also the sorted module names `pml` imports (its non-PML tags)."""
    if config.pml_key == "schema":
        return _key("pml", owner, schema)
    names = {name for name in OPEN_TAG.findall(pml[:config.max_scan_chars]) if name not in RESERVED_NAMES}
    return _key("pml", owner, schema, *sorted(names))


def _chat_key(owner: str, salt: str, body: dict[str, Any], config: AffinityConfig) -> AffinityKey | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    schema = body.get("schema")
    if isinstance(schema, str):  # message content is PML: its tags import the schema's modules
        text = "".join(_content_text(m.get("content")) for m in messages if isinstance(m, dict))
        return _pml_key(owner, schema, text, config)
    head = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        head.append(f"{message.get('role')}\0{_content_text(message.get('content'))}\0")
        if message.get("role") == "user":
            break
    return _key("prefix", owner, salt, "chat", "".join(head)[:config.prefix_chars])


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _start_tag_attribute(text: Any, tag: str, attribute: str, config: AffinityConfig) -> str | None:
    """The value of `attribute` on the first `<tag ...>` start tag within the first `max_scan_chars`
    characters of `text` (None if there is none). One forward pass: `str.find` for the tag, then its
    attributes one anchored match at a time, stopping at the first thing that is not an attribute."""
    if not isinstance(text, str):
        return None
    text, opening = text[:config.max_scan_chars], "<" + tag
    at = text.find(opening)
    while at >= 0:
        after = at + len(opening)
        if after == len(text) or text[after] in "/>" or text[after].isspace():
            break
        at = text.find(opening, after)  # `<prompts`: another tag
    if at < 0:
        return None
    position = at + len(opening)
    while (match := ATTRIBUTE.match(text, position)) is not None:
        if match.group(1) == attribute:
            return match.group(2) if match.group(2) is not None else match.group(3)
        position = match.end()
    return None


def _key(kind: KeyKind, *parts: str) -> AffinityKey:
    digest = hashlib.blake2b(kind.encode(), digest_size=16)
    for part in parts:  # length-prefixed: no two part lists hash the same bytes
        data = part.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little") + data)
    return AffinityKey(kind, digest.digest())
