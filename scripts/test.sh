#!/usr/bin/env bash
# Installs what is needed (idempotent) and runs the test suite (18-25 min on 2 cores, as loaded): each test file's name with
# its progress, then the slowest tests (pyproject.toml's addopts). Arguments go to pytest (e.g. -k aot, -x;
# --extended adds the tests marked `extended`, the wider matrix the default run samples: tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest "$@"
