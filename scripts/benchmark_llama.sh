#!/usr/bin/env bash
# Throughput per batch size, after ppl.llm.serving's benchmark_llama.sh: one CSV line per batch size,
#   batch,prefill(ms),decode(ms),avg(ms),tps,mem(gib)
#
#   MODEL_PATH=out/demo/pmx_2 TP=2 scripts/benchmark_llama.sh
#   PARAMS=path/to/pmx_params.json TP=2 scripts/benchmark_llama.sh      (random weights, no checkpoint)
#
# Settings from the environment (defaults in brackets):
#   MODEL_PATH   PMX directory split into TP shards, or
#   PARAMS       a pmx_params.json benchmarked with random weights
#   TP           ranks, started with scripts/mpirun.sh when > 1      [1]
#   BATCH_SIZES  space- or comma-separated                           [1 2 4 8 16 32 64 128 256]
#   INPUT_LEN    prompt tokens (random ids)                          [8]
#   TOKENS_FILE  prompts as token ids, one per line (overrides INPUT_LEN)
#   GEN_LEN      tokens generated per sequence                       [256]
#   WARMUP_LOOPS / BENCHMARK_LOOPS                                   [1 / 1]
#   CSV          also write the CSV to this file
#   EXTRA        more flags for `python -m runner bench` (e.g. "--quantized_cache True --device cuda")
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  sed -n '2,/^#   EXTRA/p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
PYTHON=${PYTHON:-$( [ -x "$here/.venv/bin/python" ] && echo "$here/.venv/bin/python" || command -v python3 )}
TP=${TP:-1}
args=()
if [ -n "${PARAMS:-}" ]; then
  args+=("$PARAMS" --random_weights)
elif [ -n "${MODEL_PATH:-}" ]; then
  args+=("$MODEL_PATH")
else
  echo "error: set MODEL_PATH (a PMX directory) or PARAMS (a pmx_params.json for random weights)" >&2
  exit 2
fi
args+=(--batch_sizes "${BATCH_SIZES:-1 2 4 8 16 32 64 128 256}" --input_len "${INPUT_LEN:-8}"
       --gen_len "${GEN_LEN:-256}" --warmup_loops "${WARMUP_LOOPS:-1}" --benchmark_loops "${BENCHMARK_LOOPS:-1}")
[ -n "${TOKENS_FILE:-}" ] && args+=(--tokens_file "$TOKENS_FILE")
[ -n "${CSV:-}" ] && args+=(--csv "$CSV")
# shellcheck disable=SC2206
[ -n "${EXTRA:-}" ] && args+=($EXTRA)
if [ "$TP" -gt 1 ]; then
  exec "$here/scripts/mpirun.sh" -np "$TP" "$PYTHON" -m runner bench "${args[@]}"
fi
exec "$PYTHON" -m runner bench "${args[@]}"
