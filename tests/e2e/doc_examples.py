"""The fenced examples of README.md and docs/*.md, with what their markers say to do with them.

A marker is an HTML comment (invisible once rendered) on the line right before a fence:

    <!-- example: run -->                      run it; it must succeed
    <!-- example: run, expect "Atlantic" -->   ... and its output (a prompt's answer) must contain each string
    <!-- example: skip (needs Ray Serve) -->   never run; the reason in parentheses is required
    <!-- example: response -->                 a json fence: a response of the example before it; every
                                               key it shows must be in the real response

`<!-- examples: skip (reason) -->` on a line of its own marks every unmarked fence after it in that file
(benchmark commands). Fences of a runnable language (bash, python, xml) must carry one of these: a new
example is either run by tests/e2e/test_docs_examples.py or skipped with its reason. Fences of other
languages (json outputs, diagrams) are text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE_LANGUAGES = ("bash", "python", "xml")
DEFAULT_URLS = ("http://127.0.0.1:8000", "http://localhost:8000", "localhost:8000", "127.0.0.1:8000")

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*example:\s*(run|skip|response)\b(.*?)-->\s*$")
_FILE_MARKER = re.compile(r"^<!--\s*examples:\s*skip\s*\((.+)\)\s*-->\s*$")
_EXPECT = re.compile(r'"([^"]+)"')
_REASON = re.compile(r"^\s*\((.+)\)\s*$")


@dataclass(frozen=True, slots=True)
class Example:
    """One fenced block: where it is, its language and text, and what its marker says."""

    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    text: str
    action: str | None  # run | skip | response; None: unmarked
    expect: tuple[str, ...] = ()
    reason: str = ""

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_paths() -> list[Path]:
    """README.md first, then docs/*.md by name: the order a reader meets them, and the run order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def examples(path: Path) -> list[Example]:
    """Every fenced block of one markdown file, in order. Raises ValueError for a malformed marker."""
    lines = path.read_text().splitlines()
    found: list[Example] = []
    file_skip = ""
    i = 0
    while i < len(lines):
        if match := _FILE_MARKER.match(lines[i]):
            file_skip = match.group(1).strip()
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        language, text = fence.group(1), "\n".join(lines[i + 1: end]) + "\n"
        action, expect, reason = _marker(path, i, lines[i - 1] if i else "")
        if action is None and file_skip and language in RUNNABLE_LANGUAGES:
            action, reason = "skip", file_skip
        found.append(Example(path, i + 1, language, text, action, expect, reason))
        i = end + 1
    return found


def _marker(path: Path, index: int, line: str) -> tuple[str | None, tuple[str, ...], str]:
    if "example:" not in line:
        return None, (), ""
    match = _MARKER.match(line.strip())
    if match is None:
        raise ValueError(f"{path}:{index}: malformed example marker {line!r}")
    action, rest = match.group(1), match.group(2).strip()
    if action == "skip":
        reason = _REASON.match(rest)
        if reason is None:
            raise ValueError(f"{path}:{index}: a skipped example needs its reason in parentheses: {line!r}")
        return action, (), reason.group(1).strip()
    if rest and not rest.startswith(", expect"):
        raise ValueError(f"{path}:{index}: expected ', expect \"...\"' after '{action}': {line!r}")
    return action, tuple(_EXPECT.findall(rest)), ""


def with_base_url(text: str, base_url: str) -> str:
    """The example's text with the README's server address replaced by `base_url` (http://host:port)."""
    for default in DEFAULT_URLS:
        target = base_url if default.startswith("http") else base_url.removeprefix("http://")
        text = text.replace(default, target)
    return text


@dataclass(frozen=True, slots=True)
class CurlCall:
    """What the text says about one curl command of a bash example: `# 201 {"name": ...}` after it."""

    status: int
    keys: tuple[str, ...]  # JSON keys the response must have (at any depth)
    values: tuple[tuple[str, object], ...]  # (key, string or bool value) pairs some object must carry


_STATUS = re.compile(r"^\s*(\d{3})\b")
_KEY = re.compile(r'"([A-Za-z_][A-Za-z0-9_]*)"\s*:')
_VALUE = re.compile(r'"([A-Za-z_][A-Za-z0-9_]*)"\s*:\s*("(?:[^"\\]|\\.)*"|true|false)')


def curl_calls(script: str) -> list[CurlCall]:
    """One CurlCall per curl command in `script`, in order, read from the first shell comment after the
    command starts (on its last line or on the lines after it, before the next command)."""
    calls: list[list[str]] = []
    for starts_command, comment in _shell_lines(script):
        if starts_command:
            calls.append([])
        if comment is not None and calls and not calls[-1]:
            calls[-1].append(comment)
    return [_annotation(texts[0] if texts else "") for texts in calls]


def _annotation(comment: str) -> CurlCall:
    status = _STATUS.match(comment)
    values = tuple((key, _literal(raw)) for key, raw in _VALUE.findall(comment)
                   if "…" not in raw and "..." not in raw)
    return CurlCall(int(status.group(1)) if status else 200, tuple(dict.fromkeys(_KEY.findall(comment))), values)


def _literal(raw: str) -> object:
    return {"true": True, "false": False}.get(raw, raw[1:-1] if raw.startswith('"') else raw)


def _shell_lines(script: str):
    """(starts a curl command, its comment or None) per line, quotes followed across lines as bash does."""
    quote = None  # the open quote character at the start of the line, if any
    for line in script.splitlines():
        starts = quote is None and line.lstrip().startswith("curl ")
        comment = None
        i = 0
        while i < len(line):
            char = line[i]
            if quote == "'":
                quote = None if char == "'" else quote
            elif quote == '"':
                if char == "\\":
                    i += 1
                elif char == '"':
                    quote = None
            elif char in "'\"":
                quote = char
            elif char == "\\":
                i += 1
            elif char == "#" and (i == 0 or line[i - 1].isspace()):
                comment = line[i + 1:].strip()
                break
            i += 1
        yield starts, comment
