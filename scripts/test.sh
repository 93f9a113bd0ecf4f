#!/usr/bin/env bash
# Installs everything the test suite needs, then runs it (lint and type check first: an error in either
# fails the run; mypy's settings are [tool.mypy] in pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
python3 -m ruff check promptcache tests benchmarks
python3 -m mypy
python3 -m pytest "$@"
