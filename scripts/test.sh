#!/usr/bin/env bash
# Installs what is needed (idempotent) and runs the test suite (~17.5 min on 2 cores, caches empty), then the slowest
# tests (pyproject.toml's addopts). Arguments go to pytest (e.g. -k aot, -x; --extended adds the tests marked `extended`, the
# wider matrix the default run samples: tests/conftest.py). With 2 cores or more the tests run on two pytest-xdist
# workers (the suite alone keeps ~1.2 cores busy: tests/conftest.py says how they are grouped); -n 0 runs them in this
# process, -n N on N workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
workers=()
case " $* " in
  *" -n"* | *" --numprocesses"* | *"no:xdist"*) ;;
  *) [ "$(nproc)" -ge 2 ] && workers=(-n 2) ;;
esac
# -v: under xdist, each test's line names its worker, its progress and its file
exec .venv/bin/python -m pytest ${workers[@]+"${workers[@]}" -v} --dist loadgroup --no-loadscope-reorder "$@"
