#!/usr/bin/env bash
# The main job, end to end: install (idempotent), convert a real instruct model to PMX (SmolLM2-135M-Instruct, from
# the Q4_1 GGUF file llama.cpp runs), split it in 3 (its 9 query and 3 KV heads), check that merging gives back the
# same bytes, then ask it a question under `mpirun -np 3` in its own chat template (greedy).
# The small story model the README's other blocks use is converted and split in 2 as well (out/demo/pmx, pmx_2).
# Uses ../shared/models; where it is absent, a small random-weight model is made instead (its text is gibberish).
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
SMOL=../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$SMOL" ]; then
  PROMPT=${PROMPT:-Once upon a time}
  echo "demo: $SMOL not found; mpirun -np 2 scripts/Demo.py --prompt \"$PROMPT\" --max_gen_len 40 on $WORK/pmx_2"
  scripts/mpirun.sh -np 2 $PY scripts/Demo.py --ckpt_dir "$WORK/pmx_2" --prompt "$PROMPT" --max_gen_len 40 --show_ids
  exit 0
fi
$PY scripts/ConvertWeightToPmx.py --input_dir "$SMOL" --output_dir "$WORK/smollm2" --overwrite
$PY scripts/Split.py --input_dir "$WORK/smollm2" --num_shards 3 --output_dir "$WORK/smollm2_3" --overwrite
$PY scripts/Merge.py --input_dir "$WORK/smollm2_3" --num_shards 3 --output_dir "$WORK/smollm2_merged" --overwrite
cmp "$WORK/smollm2/model.00.safetensors" "$WORK/smollm2_merged/model.00.safetensors"
echo "demo: merge(split(SmolLM2, 3)) is bit-identical to the converted model"
PROMPT=${PROMPT:-What is the capital of France?}
echo "demo: mpirun -np 3 scripts/Demo.py --chat true --prompt \"$PROMPT\""
scripts/mpirun.sh -np 3 $PY scripts/Demo.py --ckpt_dir "$WORK/smollm2_3" --chat true --prompt "$PROMPT" \
  --max_gen_len 64 --compile off
