#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with the CPU build of torch 2.13.0, the package
# (editable), its test, MPI, Triton, structured-output and GGUF extras, and MPICH's mpirun. Re-running it only checks what is there.
# Each step says what it does and how long it took (a first install takes ~100 s on 2 cores, downloads included).
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
# --no-compile, then compileall on every core: pip writes the bytecode of the ~14,500 modules it installs on one core
# (~60 s of a first install on 2 cores; ~38 s this way). Every module gets its .pyc either way, which matters where
# PYTHONDONTWRITEBYTECODE is set: a module without one is compiled again by every process that imports it.
step "installing torch 2.13.0 (its CPU build)" .venv/bin/python -m pip install -q --no-compile torch==2.13.0
step "installing pmx-runner (editable) with its test, MPI, Triton, structured-output and GGUF extras, and MPICH" \
  .venv/bin/python -m pip install -q --no-compile -e ".[test,mpi,triton,structured,gguf]" mpich
compile_all() {  # (a package may ship a file that does not compile, e.g. a template: pip skips those too)
  .venv/bin/python -m compileall -q -j 0 .venv/lib/python*/site-packages > /dev/null || true
}
step "compiling the installed modules' bytecode (every core)" compile_all
step "checking the imports" \
  .venv/bin/python -c "import xdist, torch, transformers, mpi4py, safetensors, sentencepiece, tokenizers, tiktoken, fire, triton, xgrammar, onnx, onnxruntime, onnxruntime_extensions, pydantic, prometheus_client, msgspec, httptools, uvloop, hypothesis, schemathesis, gguf, accelerate"
touch "$stamp"
echo "install: ready in $((SECONDS - start)) s (.venv)"
