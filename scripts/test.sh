#!/usr/bin/env bash
# Installs everything the test suite needs, then runs it (lint first: a lint error fails the run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
python3 -m ruff check promptcache tests benchmarks
python3 -m pytest "$@"
