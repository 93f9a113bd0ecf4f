"""`promptcache serve --replicas N`: a local Ray cluster from the command line, stopped by SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.model_factories import make_test_tokenizer, make_tiny_model
from tests.redis_server import free_port

SCHEMA = ('<schema name="cli"><system>Be brief.</system><user><module name="doc">Bees make honey.</module></user>'
          '</schema>')


def test_replicas_need_a_shared_redis():
    result = subprocess.run([sys.executable, "-m", "promptcache.cli", "serve", "--replicas", "2"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--redis-url" in result.stderr


@pytest.mark.slow
def test_serve_replicas_runs_a_local_ray_cluster(tmp_path, redis_server):
    pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed")
    tokenizer = make_test_tokenizer()
    make_tiny_model("qwen2", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "promptcache.cli", "serve", "--replicas", "2",
                                "--model", str(tmp_path / "model"), "--redis-url", redis_server.url,
                                "--port", str(port), "--no-examples", "--log-level", "warning"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert process.poll() is None, "promptcache serve --replicas exited early"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError("the cluster did not become ready in 180 s")
        # /health has no affinity key (least loaded, ties at random): once it has come from both replicas,
        # the gateway's router knows both, and the owner of a key no longer changes under us.
        seen: set[str] = set()
        while len(seen) < 2 and time.monotonic() < deadline + 30:
            seen.add(httpx.get(url + "/health", timeout=10).headers["x-promptcache-replica"])
        assert len(seen) == 2, "the router never reached the second replica"
        assert httpx.post(url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).status_code == 201
        body = {"prompt": '<prompt schema="cli"><user><doc/>Who?</user><assistant/></prompt>', "max_tokens": 3}
        replicas = {httpx.post(url + "/v1/generate", json=body, timeout=60).headers["x-promptcache-replica"]
                    for _ in range(3)}
        assert len(replicas) == 1  # one schema and module set: one replica
    finally:
        process.send_signal(signal.SIGTERM)  # stops Serve and the Ray processes it started
        output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output[-3000:]  # a clean stop, not Ray's SIGTERM abort
