#!/usr/bin/env bash
# Installs what is needed (idempotent) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest -q "$@"
