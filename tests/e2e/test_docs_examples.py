"""The docs run: every example of README.md and docs/*.md marked runnable (the markers:
tests/e2e/doc_examples.py) is executed, in reading order, against a server started as the README starts
it — `promptcache serve` with the built-in model and the preloaded example schemas, in a clean
environment, on a free loopback port — and must do what the text around it says.

- bash: run with `bash -euo pipefail` (the README's address replaced by the server's); each `curl`
  must answer the status its `# NNN {...}` comment names (200 when none), with every JSON key the
  comment shows and the string and boolean values it spells out; every generation it gets (JSON or
  server-sent events) has a non-empty answer.
- python: run in a subprocess; it must exit 0 (the SDK and the openai package raise on any error
  status) and print what its marker expects.
- xml: a `<schema>` is uploaded (201); a `<prompt>` is generated from greedily (200) and must answer
  something non-empty (and what its marker expects).
- a json fence marked as a response: every key it shows is in the previous example's last response.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests import numeric_paths
from tests.e2e.answer_margins import RecordingProxy, answers, deciding_margins
from tests.e2e.doc_examples import (
    ROOT,
    RUNNABLE_LANGUAGES,
    CurlCall,
    Example,
    curl_calls,
    doc_paths,
    examples,
    with_base_url,
)
from tests.redis_server import free_port

# The least margin (nats) by which every token of an expected answer, up to the expected string, beats the runner-up.
# Between SmolLM2's fp32 and bf16 paths the gap between a greedy token and its runner-up moved by 0.06 nats at the
# median and 0.44 at most (313 tokens of 10 chat answers; 4 of them flipped); another CPU's bf16 kernels move it
# less. An example must not depend on where that lands.
MIN_MARGIN = 0.5
ALL = [e for path in doc_paths() for e in examples(path)]
MARKED = [e for e in ALL if e.action is not None]
GENERATE = {"max_tokens": 48, "temperature": 0}
# Records every call of the example's curl in $DOC_CALLS/<n>.status and <n>.body, and prints the body.
CURL_RECORDER = """curl() {
  local n; n=$(( $(find "$DOC_CALLS" -name '*.status' | wc -l) + 1 ))
  command curl "$@" -o "$DOC_CALLS/$n.body" -w '%{http_code}' > "$DOC_CALLS/$n.status"
  cat "$DOC_CALLS/$n.body"
}
"""


class DocServer:
    """`promptcache serve` in a subprocess, its output in a log file; `last` is the last response body an
    example got (what a `response` fence describes)."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.server_url = f"http://127.0.0.1:{self.port}"
        self.proxy = RecordingProxy(self.server_url)
        self.url = self.proxy.url  # what the examples talk to: the proxy records their generations
        self.log_path = log_path
        self.last: object = None
        command = shutil.which("promptcache")
        argv = [command] if command else [sys.executable, "-m", "promptcache.cli"]
        # A new user's environment: no PROMPTCACHE_* settings (the suite's conftest sets a dtype), but for those of
        # the numeric path a rerun names (tests/numeric_paths.py).
        env = {k: v for k, v in os.environ.items() if not k.startswith("PROMPTCACHE_")}
        env.update(path.env if (path := numeric_paths.selected()) is not None else {})
        self.log = log_path.open("w")
        self.process = subprocess.Popen([*argv, "serve", "--port", str(self.port)], env=env, cwd=ROOT,
                                        stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log_path.read_text()
            try:
                if httpx.get(self.server_url + "/health", timeout=2).status_code == 200:
                    self.proxy.start()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("the server did not become ready:\n" + self.log_path.read_text())

    def stop(self) -> None:
        self.proxy.stop()
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


@pytest.fixture(scope="module")
def doc_server(tmp_path_factory):
    server = DocServer(tmp_path_factory.mktemp("docs") / "serve.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_every_example_in_a_runnable_language_is_marked():
    unmarked = [e.name for e in ALL if e.language in RUNNABLE_LANGUAGES and e.action is None]
    assert not unmarked, f"mark these as run or skip (reason): {unmarked}"
    assert all(e.reason for e in MARKED if e.action == "skip")
    assert all(e.language == "json" for e in MARKED if e.action == "response")


def test_the_docs_have_runnable_examples():
    runnable = [e for e in MARKED if e.action == "run"]
    assert len(runnable) >= 20, [e.name for e in runnable]
    assert {e.language for e in runnable} == set(RUNNABLE_LANGUAGES)


def test_every_setting_is_in_the_settings_table():
    """docs/api.md's Settings table names every field of ServerSettings (PROMPTCACHE_<NAME>), and no other."""
    from promptcache.server.settings import ServerSettings

    text = (ROOT / "docs" / "api.md").read_text()
    table = text[text.index("## Settings"):text.index("## Status codes")]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    documented = {name for row in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row)}
    assert documented == {name.upper() for name in ServerSettings.model_fields}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("example", MARKED, ids=[e.name for e in MARKED])
def test_doc_example(example: Example, doc_server: DocServer, tmp_path):
    if example.action == "skip":
        pytest.skip(example.reason)
    if example.action == "response":
        _check_sample(json.loads(example.text), doc_server.last, "")
        return
    doc_server.proxy.take()
    run = {"bash": _run_bash, "python": _run_python, "xml": _run_xml}[example.language]
    output = run(example, doc_server, tmp_path)
    for expected in example.expect:
        assert expected.lower() in output.lower(), f"{example.name}: {expected!r} not in the output:\n{output}"
    _check_margins(example, doc_server, output)


def _check_margins(example: Example, server: DocServer, output: str) -> None:
    """Every expected string that only a greedy answer puts in the output was chosen by a clear margin, token by
    token up to its end (one the example prints anyway, from its prompt or a report, is no answer's doing)."""
    generations = server.proxy.take()
    rest = output
    for answer in (answer for generation in generations for answer in answers(generation)):
        rest = rest.replace(answer, "").replace(json.dumps(answer)[1:-1], "")
    for expected in (e for e in example.expect if e.lower() not in rest.lower()):
        for generation in generations:
            for deciding in deciding_margins(server.server_url, generation, expected) or ():
                weakest = min(deciding, key=lambda token: token.margin)
                assert weakest.margin >= MIN_MARGIN, (
                    f"{example.name}: {expected!r} hangs on a near-tie: token {weakest.token!r} beat the runner-up "
                    f"by {weakest.margin:.3f} nats (at least {MIN_MARGIN} needed); margins up to it: "
                    f"{[(t.token, round(t.margin, 3)) for t in deciding]}")


def test_the_server_started_without_warnings(doc_server: DocServer):
    """Last: after every example ran, nothing the server printed is a warning or a traceback."""
    log = doc_server.log_path.read_text()
    assert "Warning" not in log and "Traceback" not in log, log


def _run_xml(example: Example, server: DocServer, tmp_path: Path) -> str:
    text = example.text
    if text.lstrip().startswith("<schema"):
        response = httpx.post(server.url + "/v1/schemas", json={"pml": text}, timeout=300)
        assert response.status_code == 201, f"{example.name}: {response.status_code} {response.text}"
        server.last = response.json()
        return response.text
    response = httpx.post(server.url + "/v1/generate", json={"prompt": text, **GENERATE}, timeout=300)
    assert response.status_code == 200, f"{example.name}: {response.status_code} {response.text}"
    server.last = response.json()
    answer = server.last["choices"][0]["text"]
    assert answer.strip(), f"{example.name}: empty answer: {server.last}"
    return answer


def _run_python(example: Example, server: DocServer, tmp_path: Path) -> str:
    result = subprocess.run([sys.executable, "-c", with_base_url(example.text, server.url)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{example.name} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _run_bash(example: Example, server: DocServer, tmp_path: Path) -> str:
    calls_dir = tmp_path / "calls"
    calls_dir.mkdir()
    script = tmp_path / "example.sh"
    script.write_text(CURL_RECORDER + with_base_url(example.text, server.url))
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # `python` is this one
    result = subprocess.run(["bash", "-euo", "pipefail", str(script)], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "DOC_CALLS": str(calls_dir), "PATH": path})
    assert result.returncode == 0, f"{example.name} failed:\n{result.stdout}\n{result.stderr}"
    expected = curl_calls(example.text)
    made = sorted(calls_dir.glob("*.status"), key=lambda p: int(p.stem))
    assert len(made) == len(expected), f"{example.name}: {len(expected)} curl commands, {len(made)} calls made"
    for number, (status_file, call) in enumerate(zip(made, expected), 1):
        body = (calls_dir / f"{status_file.stem}.body").read_text()
        _check_call(f"{example.name} curl #{number}", int(status_file.read_text()), body, call, server)
    return result.stdout


def _check_call(name: str, status: int, body: str, call: CurlCall, server: DocServer) -> None:
    assert status == call.status, f"{name}: status {status}, the text says {call.status}: {body}"
    if not body.strip():
        assert not call.keys, f"{name}: empty body, the text shows {call.keys}"
        return
    payloads = _payloads(body)
    server.last = payloads[-1]
    keys = {k for p in payloads for k in _keys(p)}
    assert set(call.keys) <= keys, f"{name}: missing {set(call.keys) - keys} in {body}"
    for key, value in call.values:
        assert any(v == value for p in payloads for v in _values(p, key)), f"{name}: no {key}={value!r} in {body}"
    texts = [_answer(p) for p in payloads if isinstance(p, dict) and "choices" in p]
    if texts:
        assert "".join(texts).strip(), f"{name}: an empty answer: {body}"


def _payloads(body: str) -> list:
    """A JSON body, or the JSON events of a server-sent stream, in order."""
    if body.lstrip().startswith("data:"):
        events = [line[len("data:"):].strip() for line in body.splitlines() if line.startswith("data:")]
        return [json.loads(e) for e in events if e != "[DONE]"]
    return [json.loads(body)]


def _answer(payload: dict) -> str:
    return "".join(c.get("text") or (c.get("message") or c.get("delta") or {}).get("content") or ""
                   for c in payload["choices"])


def _keys(value) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


def _values(value, key: str):
    if isinstance(value, dict):
        if key in value:
            yield value[key]
        for v in value.values():
            yield from _values(v, key)
    elif isinstance(value, list):
        for v in value:
            yield from _values(v, key)


def _check_sample(sample, actual, where: str) -> None:
    """Every key of the documented `sample` is in `actual`, recursively (a list: its first element)."""
    if isinstance(sample, dict):
        assert isinstance(actual, dict), f"{where or 'response'}: expected an object, got {actual!r}"
        for key, value in sample.items():
            assert key in actual, f"{where or 'response'}: no {key!r} in {sorted(actual)}"
            _check_sample(value, actual[key], f"{where}.{key}")
    elif isinstance(sample, list) and sample and isinstance(sample[0], (dict, list)):
        assert isinstance(actual, list) and actual, f"{where}: expected a non-empty list, got {actual!r}"
        _check_sample(sample[0], actual[0], f"{where}[0]")
