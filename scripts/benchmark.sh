#!/usr/bin/env bash
# Replay one dumped step on this rank, time it and check it against the dump (ppl.pmx's benchmark.sh).
#
#   mpirun -np N scripts/benchmark.sh STEP        (scripts/mpirun.sh adds what Open MPI needs here)
#
# The rank comes from MPI (PMI_RANK under MPICH, OMPI_COMM_WORLD_RANK under Open MPI), else 0.
# Settings, from the environment (paths relative to the current directory):
#   MODEL_PATH             PMX directory split into N shards      (default: out/demo/pmx_2 of the repo), or an
#                          export of scripts/Export.py (params.json, model_slice_r/): the step then runs in
#                          onnxruntime (python -m runner onnx_replay), and the updated cache is checked
#                          against step STEP+1 where it was dumped
#   TEST_DATA_DIR          Demo.py --dump_tensor_path of the run  (default: out/dump of the repo)
#   OUTPUT_DIR             where each rank writes rank_r/*.bin    (default: out/replay of the repo)
#   MIN_PROFILING_SECONDS  profile at least this long             (default: 1)
#   WARMUP_ITERATIONS      untimed runs first                     (default: 2)
#   PYTHON                 interpreter (default: the repo's .venv, else python3)
#   PMX_COLLECTIVE_TIMEOUT seconds a collective may wait for the other ranks (default: 30)
# Exit status: 0 when every rank's logits agree with the dump, 1 when one does not, 2 on bad input.
# Every rank starts Python, which initialises MPI before checking anything, so a rank with bad input
# (e.g. no rank_r in TEST_DATA_DIR under -np 3 for a 2-rank dump) aborts the whole job instead of
# leaving the others waiting in MPI's start-up.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  sed -n '2,/^# Exit status/p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
if [ $# -ne 1 ] || ! [[ "$1" =~ ^[0-9]+$ ]]; then  # the same on every rank: they all stop here
  echo "usage: mpirun -np N $0 STEP   (STEP: a step number that was dumped, e.g. 0 or 1; --help for settings)" >&2
  exit 2
fi
STEP=$1
MODEL_PATH=${MODEL_PATH:-$here/out/demo/pmx_2}
TEST_DATA_DIR=${TEST_DATA_DIR:-$here/out/dump}
OUTPUT_DIR=${OUTPUT_DIR:-$here/out/replay}
MIN_PROFILING_SECONDS=${MIN_PROFILING_SECONDS:-1}
WARMUP_ITERATIONS=${WARMUP_ITERATIONS:-2}
PYTHON=${PYTHON:-$( [ -x "$here/.venv/bin/python" ] && echo "$here/.venv/bin/python" || command -v python3 )}
if [ -f "$MODEL_PATH/params.json" ] && [ -d "$MODEL_PATH/model_slice_0" ]; then
  exec "$PYTHON" -m runner onnx_replay --export_path "$MODEL_PATH" --dump_dir "$TEST_DATA_DIR" --step "$STEP" \
    --output_dir "$OUTPUT_DIR" --warmup "$WARMUP_ITERATIONS" --min_profiling_seconds "$MIN_PROFILING_SECONDS"
fi
exec "$PYTHON" -m runner replay --ckpt_dir "$MODEL_PATH" --dump_dir "$TEST_DATA_DIR" --step "$STEP" \
  --output_dir "$OUTPUT_DIR" --warmup "$WARMUP_ITERATIONS" --min_profiling_seconds "$MIN_PROFILING_SECONDS"
