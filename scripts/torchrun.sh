#!/usr/bin/env bash
# torchrun as this project launches it (runner/parallel/torchrun.py): torchrun's flags and exit status, without its
# OMP_NUM_THREADS banner (the runner sets each rank's threads itself), without the /tmp/torchelastic_* directory it
# leaves on every run, and one line instead of its traceback when it is stopped or a worker fails.
# Usage: scripts/torchrun.sh --nproc_per_node N scripts/Demo.py ...
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
PY=${PYTHON:-$( [ -x "$here/.venv/bin/python" ] && echo "$here/.venv/bin/python" || command -v python3 )}
exec "$PY" -m runner.parallel.torchrun "$@"
