"""The Prompt Cache reference implementation's own files, unchanged, over the real server with SmolLM2:
every schema of its examples/ and benchmark/schema/ (and its README's) uploads, and its README and demo
prompts answer. Needs a copy of github.com/yale-sys/prompt-cache: set PROMPT_CACHE_REFERENCE to a
checkout or a bare git directory; skipped otherwise (test_prompt_cache_prompts.py covers the same shapes
with schemas written here). Prints the counts, e.g. "13 of 13 schemas upload; 4 of 5 prompts answer"."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import LiveServer, settings_for

REFERENCE = os.environ.get("PROMPT_CACHE_REFERENCE", "")
pytestmark = pytest.mark.skipif(not REFERENCE or not Path(REFERENCE).exists(),
                                reason="set PROMPT_CACHE_REFERENCE to a copy of yale-sys/prompt-cache")


def _read(path: str) -> str:
    root = Path(REFERENCE)
    if (root / path).exists():
        return (root / path).read_text()
    return subprocess.run(["git", f"--git-dir={root}", "show", f"HEAD:{path}"], capture_output=True, text=True,
                          check=True).stdout


def _files() -> list[str]:
    root = Path(REFERENCE)
    if (root / "examples").is_dir():
        names = [str(p.relative_to(root)) for d in ("examples", "benchmark/schema") for p in (root / d).rglob("*.xml")]
    else:
        names = subprocess.run(["git", f"--git-dir={root}", "ls-tree", "-r", "--name-only", "HEAD"],
                               capture_output=True, text=True, check=True).stdout.split()
    return sorted(n for n in names if re.match(r"(examples|benchmark/schema)/.*\.xml$", n))


def _upload(url: str, pml: str) -> httpx.Response:
    name = re.search(r"<schema\s+name=[\"']([^\"']+)", pml).group(1)
    httpx.delete(f"{url}/v1/schemas/{name}")  # several files share a name: one at a time
    return httpx.post(url + "/v1/schemas", json={"pml": pml}, timeout=900)


def test_reference_schemas_upload_and_prompts_answer(smollm2):
    readme = _read("README.md")
    blocks = re.findall(r"```xml\n(.*?)```", readme, flags=re.S)
    schemas = [(f, _read(f)) for f in _files() if "<schema" in _read(f)]
    schemas += [("README.md", b) for b in blocks if "<schema" in b]
    demo = re.search(r'prompt_text = f"""(.*?)"""', _read("demo.py"), re.S).group(1).strip()
    prompts = [("README demo", next(b for b in blocks if "code-generation-game" in b),
                "examples/code_generation_game.xml"),
               ("README persona", next(b for b in blocks if "schema='persona'" in b),
                "examples/persona_generation.xml"),
               ("README default", next(b for b in blocks if 'schema="default"' in b and "<prompt" in b), "README.md"),
               ("prompt_mbti.xml", _read("benchmark/schema/test/prompt_mbti.xml"),
                "benchmark/schema/test/schema_mbti.xml"),
               ("demo.py", demo, "examples/code_generation_game.xml")]
    server = LiveServer(settings_for(max_kv_bytes=512 << 20), lambda: smollm2).start()
    try:
        uploaded = {}
        for name, pml in schemas:
            response = _upload(server.url, pml)
            print(name, response.status_code, response.text[:200] if response.status_code != 201 else "")
            uploaded[name] = response.status_code == 201
        answered = {}
        for name, prompt, schema_file in prompts:
            _upload(server.url, dict(schemas)[schema_file])
            response = httpx.post(server.url + "/v1/generate", timeout=900,
                                  json={"prompt": prompt.strip(), "max_tokens": 16, "temperature": 0})
            body = response.json()
            text = body["choices"][0]["text"] if response.status_code == 200 else ""
            print(name, response.status_code, repr(text) if text else response.text[:300])
            answered[name] = bool(text.strip()) and body["cache"]["generation_prompt_added"]
        print(f"{sum(uploaded.values())} of {len(uploaded)} schemas upload; "
              f"{sum(answered.values())} of {len(answered)} prompts answer")
        assert all(uploaded.values()), uploaded
        # The README's `default` prompt imports <task2>, which its schema does not declare (the reference
        # implementation raises for it too): a 400 naming it. Without that import it answers.
        assert answered == {**{name: True for name, *_ in prompts}, "README default": False}
        default = next(p for name, p, _ in prompts if name == "README default")
        response = httpx.post(server.url + "/v1/generate", json={"prompt": default, "max_tokens": 4})
        assert response.status_code == 400 and "<task2>" in response.json()["error"]["message"]
        _upload(server.url, dict(schemas)["README.md"])
        fixed = re.sub(r"<task2 [^>]*/>", "", default)
        body = httpx.post(server.url + "/v1/generate", timeout=900,
                          json={"prompt": fixed, "max_tokens": 16, "temperature": 0}).json()
        assert body["choices"][0]["text"].strip() and body["cache"]["generation_prompt_added"]
    finally:
        server.stop()
