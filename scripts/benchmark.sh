#!/usr/bin/env bash
# Replay one dumped step on this rank, time it and check it against the dump (ppl.pmx's benchmark.sh).
#
#   mpirun -np N scripts/benchmark.sh STEP        (scripts/mpirun.sh adds what Open MPI needs here)
#
# The rank comes from MPI_LOCALRANKID (MPICH), OMPI_COMM_WORLD_RANK (Open MPI) or PMI_RANK, else 0.
# Settings, from the environment (paths relative to the current directory):
#   MODEL_PATH             PMX directory split into N shards      (default: out/demo/pmx_2 of the repo)
#   TEST_DATA_DIR          Demo.py --dump_tensor_path of the run  (default: out/dump of the repo)
#   OUTPUT_DIR             where each rank writes rank_r/*.bin    (default: out/replay of the repo)
#   MIN_PROFILING_SECONDS  profile at least this long             (default: 1)
#   WARMUP_ITERATIONS      untimed runs first                     (default: 2)
#   PYTHON                 interpreter (default: the repo's .venv, else python3)
# Exit status: 0 when every rank's logits agree with the dump, 1 when one does not, 2 on bad input.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
if [ $# -ne 1 ] || ! [[ "$1" =~ ^[0-9]+$ ]]; then
  echo "usage: mpirun -np N $0 STEP   (STEP: a step number that was dumped, e.g. 0 or 1)" >&2
  exit 2
fi
STEP=$1
RANK=${MPI_LOCALRANKID:-${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}}
MODEL_PATH=${MODEL_PATH:-$here/out/demo/pmx_2}
TEST_DATA_DIR=${TEST_DATA_DIR:-$here/out/dump}
OUTPUT_DIR=${OUTPUT_DIR:-$here/out/replay}
MIN_PROFILING_SECONDS=${MIN_PROFILING_SECONDS:-1}
WARMUP_ITERATIONS=${WARMUP_ITERATIONS:-2}
PYTHON=${PYTHON:-$( [ -x "$here/.venv/bin/python" ] && echo "$here/.venv/bin/python" || command -v python3 )}
if [ ! -f "$MODEL_PATH/pmx_params.json" ]; then
  echo "rank $RANK: error: MODEL_PATH=$MODEL_PATH is not a PMX directory (no pmx_params.json)" >&2
  exit 2
fi
if [ ! -d "$TEST_DATA_DIR/rank_$RANK" ]; then
  echo "rank $RANK: error: TEST_DATA_DIR=$TEST_DATA_DIR has no rank_$RANK (dump with Demo.py --dump_tensor_path)" >&2
  exit 2
fi
mkdir -p "$OUTPUT_DIR/rank_$RANK"
exec "$PYTHON" -m runner replay --ckpt_dir "$MODEL_PATH" --dump_dir "$TEST_DATA_DIR" --step "$STEP" \
  --output_dir "$OUTPUT_DIR" --warmup "$WARMUP_ITERATIONS" --min_profiling_seconds "$MIN_PROFILING_SECONDS"
