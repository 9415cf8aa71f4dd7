#!/usr/bin/env bash
# The main job, end to end: install (idempotent), convert the demo model to PMX, split it in 2,
# check that merging gives back the same bytes, then generate with `mpirun -np 2` (greedy, 40 tokens).
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
TINY=../shared/models/tinystories-656k
if [ -f "$TINY/config.json" ]; then  # the second real model: tied weights stored as lm_head, tokenizer.json
  $PY scripts/ConvertWeightToPmx.py --input_dir "$TINY" --output_dir "$WORK/tiny" --overwrite
  $PY scripts/Split.py --input_dir "$WORK/tiny" --num_shards 2 --output_dir "$WORK/tiny_2" --overwrite
  $PY scripts/Merge.py --input_dir "$WORK/tiny_2" --num_shards 2 --output_dir "$WORK/tiny_merged" --overwrite
  cmp "$WORK/tiny/model.00.safetensors" "$WORK/tiny_merged/model.00.safetensors"
  echo "demo: tinystories-656k round trip is bit-identical too"
fi
PROMPT=${PROMPT:-Once upon a time}
echo "demo: mpirun -np 2 scripts/Demo.py --prompt \"$PROMPT\" --max_gen_len 40"
scripts/mpirun.sh -np 2 $PY scripts/Demo.py --ckpt_dir "$WORK/pmx_2" --prompt "$PROMPT" --max_gen_len 40 --show_ids
