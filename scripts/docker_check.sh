#!/usr/bin/env bash
# Builds the CPU image (docker/Dockerfile) on this machine and checks it end to end; run it before any
# Docker change (about 5-10 minutes on a 2-core machine, so CI's default run leaves it out). Needs root:
# podman with the vfs storage driver and chroot isolation, so it works where no Docker engine runs and
# containers cannot be started (the entrypoint runs in a chroot of the mounted image, with /proc, /dev, a
# fresh cache volume and the compose secret mounted in a private mount namespace).
#
#   1. podman and mmdebstrap (apt) if missing; the base image from the registry, or, when the registry is
#      unreachable, a stand-in for python:3.11-slim bootstrapped from Debian bookworm (python3 and pip,
#      this machine's CA bundle so pip in the build trusts what pip here trusts, apt without its
#      unprivileged download user, which chroot isolation cannot switch to);
#   2. the host's torch wheel as the build's wheelhouse (the container runs the bare-metal server's torch);
#   3. the build; the image's size, its HEALTHCHECK, no C++ compiler in it;
#   4. docker/compose.yaml against the image (variables, secret, volume, port, health check);
#   5. the entrypoint refusing to serve on 0.0.0.0 without keys; then serving with compose's environment
#      (a local Redis with a password, the keys file as the secret): /health with the bf16 kernel, the
#      image's health check, a PML request with a module hit, a chat request and its exact repeat from the
#      cache, /metrics (scripts/docker_check.py);
#   6. cold-prompt TTFT (TTFT_TOKENS tokens, median of TTFT_RUNS) of the container and of a bare-metal
#      server on this machine with the same settings, prompts sent to each in turn.
# Prints JSON lines and a summary; exits 1 if a check or a target (size <= 1.5 GB, container TTFT within
# 10 % of bare metal) fails.
# Usage: sudo scripts/docker_check.sh   (DOCKER_CHECK_WORK=/tmp/promptcache-docker holds storage and logs)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${DOCKER_CHECK_WORK:-/tmp/promptcache-docker}"
IMAGE=localhost/promptcache:cpu-check
BASE="${BASE_IMAGE:-docker.io/library/python:3.11-slim}"
TTFT_TOKENS="${TTFT_TOKENS:-2048}"
TTFT_RUNS="${TTFT_RUNS:-5}"
MAX_SIZE_MB=1536
MAX_TTFT_RATIO=1.10

[ "$(id -u)" = 0 ] || { echo "docker_check: run as root (podman vfs storage, chroot)" >&2; exit 2; }
mkdir -p "$WORK"
log() { echo "docker_check: $*" >&2; }
pm() { podman --root "$WORK/storage" --runroot "$WORK/run" --storage-driver vfs "$@"; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
pids=()
container=""
cleanup() {
  # The server is unshare's child (unshare ignores SIGTERM while it runs; chroot's user switch drops the
  # parent-death signal): stop the server, unshare then exits with it.
  if [ -n "$container" ]; then
    for server in $(ps -o pid= --ppid "$container"); do kill "$server" 2>/dev/null || true; done
  fi
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  pm image unmount "$IMAGE" >/dev/null 2>&1 || true
}
trap cleanup EXIT

# 1. Tools and base image.
if ! command -v podman >/dev/null || ! command -v mmdebstrap >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman mmdebstrap >/dev/null
fi
if ! pm image exists "$BASE" && ! timeout 60 pm pull -q "$BASE" >/dev/null 2>&1; then
  BASE=localhost/python-standin:3.11
  if ! pm image exists "$BASE"; then
    log "the registry is unreachable: bootstrapping $BASE from Debian bookworm"
    rm -f "$WORK/base.tar"
    mmdebstrap --quiet --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
      --customize-hook='ln -sf python3 "$1/usr/bin/python"' \
      --customize-hook='ln -sf pip3 "$1/usr/bin/pip"' \
      --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
      --customize-hook='upload /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt' \
      --customize-hook='echo "APT::Sandbox::User \"root\";" >"$1/etc/apt/apt.conf.d/99-build-sandbox"' \
      bookworm "$WORK/base.tar"
    pm import --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' --change 'CMD ["python3"]' \
      "$WORK/base.tar" "$BASE" >/dev/null
  fi
fi

# 2. The bare-metal server's torch, handed to the build (docker/wheelhouse/ is git-ignored).
torch_version="$(python3 -c 'import torch; print(torch.__version__)')"
if ! compgen -G "docker/wheelhouse/torch-${torch_version}-*.whl" >/dev/null; then
  rm -f docker/wheelhouse/torch-*.whl
  python3 -m pip download -q --no-deps "torch==$torch_version" -d docker/wheelhouse \
    || python3 -m pip download -q --no-deps --index-url https://download.pytorch.org/whl/cpu \
         "torch==$torch_version" -d docker/wheelhouse
fi

# 3. Build; size, health check, no compiler.
log "building $IMAGE on $BASE (log: $WORK/build.log)"
started=$(date +%s)
pm build --format docker --isolation chroot --network host --pull=never --build-arg PYTHON_IMAGE="$BASE" \
  -f docker/Dockerfile -t "$IMAGE" . >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log" >&2; exit 1; }
build_s=$(( $(date +%s) - started ))
pm image inspect "$IMAGE" >"$WORK/inspect.json"
python3 scripts/docker_image_check.py inspect "$WORK/inspect.json" --env-out "$WORK/image.env" \
  --health-out "$WORK/health.json" | tee "$WORK/image.json"
mnt="$(pm image mount "$IMAGE")"
if chroot "$mnt" /bin/sh -c 'command -v c++ || command -v g++ || command -v gcc || command -v cc'; then
  log "the runtime image has a C++ compiler"; exit 1
fi
echo '{"check": "no_compiler_in_image"}'

# 4. compose.yaml against the image; a Redis like compose's (password) and the keys file as the secret.
redis_password="$(openssl rand -hex 16)"
api_key="sk-check-$(openssl rand -hex 8)"
metrics_key="$(openssl rand -hex 8)"
redis_port="$(free_port)"
port="$(free_port)"
redis-server --port "$redis_port" --bind 127.0.0.1 --requirepass "$redis_password" --save '' \
  --appendonly no >"$WORK/redis.log" 2>&1 &
pids+=($!)
python3 scripts/docker_image_check.py compose "$WORK/inspect.json" --env-out "$WORK/compose.env" \
  --set "REDIS_PASSWORD=$redis_password" --set "PROMPTCACHE_BLOB_KEY=$(openssl rand -hex 32)" \
  --redis-address "127.0.0.1:$redis_port" --port "$port"
echo "PROMPTCACHE_METRICS_KEY=$metrics_key" >>"$WORK/compose.env"
printf '{"%s": "check-team"}\n' "$api_key" >"$WORK/api-keys.json"
rm -rf "$WORK/volume" && install -d -o 10001 -g 10001 "$WORK/volume"

# Runs a command in the image as its user, with an environment file, in a private mount namespace. It
# replaces the calling shell: call it in a subshell, `( in_image ... )`, whose pid is then the server's.
in_image() {
  local env_file="$1"; shift
  exec unshare --mount --propagation private --fork --kill-child=SIGTERM /bin/sh -s "$mnt" "$env_file" "$WORK" "$@" <<'EOF'
mnt="$1" env_file="$2" work="$3"; shift 3
mkdir -p "$mnt/proc" "$mnt/dev" "$mnt/tmp" "$mnt/run"
mount -t proc proc "$mnt/proc" && mount --rbind /dev "$mnt/dev"
mount -t tmpfs tmpfs "$mnt/tmp" && mount -t tmpfs tmpfs "$mnt/run"
mkdir -p "$mnt/run/secrets" && cp "$work/api-keys.json" "$mnt/run/secrets/promptcache_api_keys"
chown 10001:10001 "$mnt/run/secrets/promptcache_api_keys"
mount --bind "$work/volume" "$mnt/home/promptcache/.cache"
exec chroot --userspec=10001:10001 "$mnt" /usr/bin/env -i HOME=/home/promptcache $(cat "$env_file") "$@"
EOF
}

# 5. The refusal, then the service.
refused=0
(in_image "$WORK/image.env" /usr/local/bin/promptcache-entrypoint) >/dev/null 2>"$WORK/refusal.log" || refused=$?
if [ "$refused" != 64 ] || ! grep -q "without API keys" "$WORK/refusal.log"; then
  log "the entrypoint did not refuse an open server on 0.0.0.0 (exit $refused)"; exit 1
fi
echo '{"check": "refuses_open_server", "exit": 64}'

wait_ready() {  # url, pid, seconds
  local deadline=$(( $(date +%s) + $3 ))
  until curl -sf "$1/health" >/dev/null; do
    kill -0 "$2" 2>/dev/null || { log "the server exited"; return 1; }
    [ "$(date +%s)" -lt "$deadline" ] || { log "not ready after $3 s"; return 1; }
    sleep 1
  done
}
started=$(date +%s)
(in_image "$WORK/compose.env" /usr/local/bin/promptcache-entrypoint) >"$WORK/container.log" 2>&1 &
container=$!
wait_ready "http://127.0.0.1:$port" "$container" 600 || { tail -30 "$WORK/container.log" >&2; exit 1; }
echo "{\"check\": \"container_ready\", \"seconds\": $(( $(date +%s) - started ))}"
grep -m1 "promptcache ready" "$WORK/container.log" >&2 || true
health_cmd="$(python3 -c 'import json, shlex, sys; print(shlex.join(json.load(open(sys.argv[1]))[1:]))' "$WORK/health.json")"
health_cmd="${health_cmd//8000/$port}"  # the image's check, on this run's port
eval "(in_image \"$WORK/compose.env\" $health_cmd)" || { log "the image's HEALTHCHECK failed"; exit 1; }
echo '{"check": "image_healthcheck", "exit": 0}'
python3 scripts/docker_check.py checks --url "http://127.0.0.1:$port" --api-key "$api_key" \
  --metrics-key "$metrics_key"

# 6. Cold TTFT: the container and a bare-metal server with the same settings (its own namespace in the
# Redis), both up, prompts sent to each in turn.
python3 -m promptcache.cli build-kernels >/dev/null || log "no bf16 kernels on bare metal"
bare_port="$(free_port)"
# compose's settings (not the image's PATH or kernel folder), on loopback.
grep '^PROMPTCACHE_' "$WORK/compose.env" | grep -v '^PROMPTCACHE_KERNEL_DIR=' >"$WORK/bare_metal.env"
printf '%s\n' PROMPTCACHE_HOST=127.0.0.1 "PROMPTCACHE_PORT=$bare_port" PROMPTCACHE_NAMESPACE=bare-metal \
  "PROMPTCACHE_API_KEYS_FILE=$WORK/api-keys.json" >>"$WORK/bare_metal.env"
# shellcheck disable=SC2046
env $(cat "$WORK/bare_metal.env") python3 -m promptcache.cli serve >"$WORK/bare_metal.log" 2>&1 &
bare=$!
pids+=("$bare")
wait_ready "http://127.0.0.1:$bare_port" "$bare" 600 || { tail -30 "$WORK/bare_metal.log" >&2; exit 1; }
python3 scripts/docker_check.py ttft --url "http://127.0.0.1:$port" --bare-metal-url "http://127.0.0.1:$bare_port" \
  --api-key "$api_key" --tokens "$TTFT_TOKENS" --runs "$TTFT_RUNS" | tee "$WORK/ttft.json"

python3 - "$WORK" "$build_s" "$MAX_SIZE_MB" "$MAX_TTFT_RATIO" <<'EOF'
import json, sys
work, build_s, max_mb, max_ratio = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
image = json.load(open(f"{work}/image.json"))
ttft = json.load(open(f"{work}/ttft.json"))
container, bare = ttft["container"], ttft["bare_metal"]
ratio = container["median_ms"] / bare["median_ms"]
summary = {"check": "summary", "size_mb": image["size_mb"], "build_s": build_s, "healthcheck": image["healthcheck"],
           "container_ttft_ms": container["median_ms"], "bare_metal_ttft_ms": bare["median_ms"],
           "ttft_ratio": round(ratio, 3), "container_attention": container["attention"]["path"],
           "bare_metal_attention": bare["attention"]["path"]}
summary["passed"] = (image["size_mb"] <= max_mb and ratio <= max_ratio and image["healthcheck"]
                     and container["attention"]["path"] == bare["attention"]["path"])
print(json.dumps(summary))
sys.exit(0 if summary["passed"] else 1)
EOF
