#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with the CPU build of torch 2.13.0, the package
# (editable), its test, MPI, Triton, structured-output and GGUF extras, and MPICH's mpirun. Re-running it only checks what is there.
# Each step says what it does and how long it took (a first install takes ~90 s, most of it downloads).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
start=$SECONDS
step() {  # step "what" command...: one line before, the seconds it took after
  local t0=$SECONDS
  echo "install: $1 ..."
  shift
  "$@"
  echo "install:   done in $((SECONDS - t0)) s"
}
stamp=.venv/.pmx-installed
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ] && [ ! "$0" -nt "$stamp" ]; then
  echo "install: .venv is up to date"
  exit 0
fi
[ -x .venv/bin/python ] || step "creating the virtual environment .venv ($("$PY" --version 2>&1))" "$PY" -m venv .venv
step "upgrading pip" .venv/bin/python -m pip install -q --upgrade pip
# torch pinned: 2.13.0 is the CPU build; an unpinned torch would pull a multi-GB CUDA build.
step "installing torch 2.13.0 (its CPU build)" .venv/bin/python -m pip install -q torch==2.13.0
step "installing pmx-runner (editable) with its test, MPI, Triton, structured-output and GGUF extras, and MPICH" \
  .venv/bin/python -m pip install -q -e ".[test,mpi,triton,structured,gguf]" mpich
step "checking the imports" \
  .venv/bin/python -c "import xdist, torch, transformers, mpi4py, safetensors, sentencepiece, tokenizers, tiktoken, fire, triton, xgrammar, onnx, onnxruntime, onnxruntime_extensions, pydantic, prometheus_client, msgspec, httptools, uvloop, hypothesis, schemathesis, gguf, accelerate"
touch "$stamp"
echo "install: ready in $((SECONDS - start)) s (.venv)"
