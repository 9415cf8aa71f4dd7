#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with the CPU build of torch 2.13.0, the package
# (editable), its test, MPI, Triton and structured-output extras, and MPICH's mpirun. Re-running it only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.pmx-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$0" -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch pinned: 2.13.0 is the CPU build; an unpinned torch would pull a multi-GB CUDA build.
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e ".[test,mpi,triton,structured]" mpich
  .venv/bin/python -c "import torch, transformers, mpi4py, safetensors, sentencepiece, tokenizers, tiktoken, fire, triton, xgrammar, onnx, onnxruntime, onnxruntime_extensions"
  touch "$stamp"
fi
