#!/usr/bin/env bash
# Installs everything the test suite needs, then runs it (lint and type check first: an error in either
# fails the run; mypy's settings are [tool.mypy] in pyproject.toml). Without arguments it then reruns the docs
# test and the default model's end-to-end test under every other numeric path this CPU can take (bf16 through
# PyTorch's attention; bf16 through our kernels where they are built): an answer decided by a near-tie would
# differ between them (tests/numeric_paths.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
python3 -m ruff check promptcache tests benchmarks
python3 -m mypy
python3 -m pytest "$@"
if [ "$#" -eq 0 ]; then
  # The Triton kernels on the CPU: Triton's interpreter must be on before triton is first imported, so they run
  # in a pytest process of their own (in the run above they skip; tests/model_runtime/triton_interpreter.py).
  echo "== the Triton kernels under Triton's interpreter"
  TRITON_INTERPRET=1 python3 -m pytest -q -W ignore::RuntimeWarning tests/model_runtime/test_triton_shared.py \
    tests/model_runtime/test_triton_decode.py
  for path in $(python3 -m tests.numeric_paths --others); do
    echo "== the docs and the default model under the numeric path $path"
    PROMPTCACHE_TEST_NUMERIC_PATH="$path" python3 -m pytest -q tests/e2e/test_docs_examples.py \
      tests/e2e/test_default_model.py
  done
fi
