#!/usr/bin/env bash
# Installs the server and serves the built-in default model on 127.0.0.1:8000 (override with flags,
# e.g. scripts/serve.sh --port 9000 --model /path/to/hf-model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh server
exec promptcache serve "$@"
