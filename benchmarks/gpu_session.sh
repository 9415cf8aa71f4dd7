#!/usr/bin/env bash
# One call on a lent GPU machine does what such a machine is for: the environment, the GPU test set, and the
# Llama-2-7B-shape decode benchmark (benchmarks/gpu_generate.py), each stage under its own time limit.
# Logs and results go under $OUT (default ./out/gpu).
#
#   bash benchmarks/gpu_session.sh [all|env|tests|bench|profile]   (all: env, tests, bench)
#   PMX_GPU_TESTS="test files", PMX_GPU_TESTS_K="-k expression", PMX_GPU_TEST_WORKERS=8  (default: the GPU set below)
#   PMX_GPU_TESTS_TIMEOUT=300  PMX_GPU_BENCH_TIMEOUT=300  PMX_GPU_PROFILE_TIMEOUT=240  (seconds)
#   PMX_GPU_BENCH_ARGS="--batches '1 8 64' ..."  (extra gpu_generate.py flags; vLLM is off: the lent machines
#   have none and cannot install it)    PMX_GPU_PROFILE_ARGS="--gen_len 32 ..."  (extra gpu_profile.py flags)
#
# Packages missing there travel as wheels in .whl/ (installed to /tmp/site), the real checkpoints in
# .gpu_shared/models (linked as ../shared when there is none), both ignored by git.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the project uninstalled: its scripts and test workers import runner
stage=${1:-all}

if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if [ -d .gpu_shared/models ] && [ ! -e ../shared ]; then ln -s "$PWD/.gpu_shared" ../shared; fi

if [[ $stage == all || $stage == env ]]; then
  { nvidia-smi; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
    $PY -c 'import sys, torch, triton; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda,
"triton", triton.__version__); p = torch.cuda.get_device_properties(0); print(p.name, p.multi_processor_count, "SMs",
round(p.total_memory / 2**30, 1), "GiB")'
    nproc; } 2>&1 | tee "$OUT/env.txt"
fi

if [[ $stage == all || $stage == tests ]]; then
  # the GPU test set: every test that runs on CUDA when it is there (the multi-rank launches written for the CPU are
  # left out: with --device auto they would ask NCCL for two ranks on the one GPU, which is refused)
  tests=${PMX_GPU_TESTS:-tests/test_triton_kernels.py tests/test_cuda_graphs.py tests/test_gpu_tp.py tests/test_gpu_generate.py tests/test_quant_engine.py}
  kexpr=${PMX_GPU_TESTS_K:-not tensor_parallel and not dump_and_replay and not quantized_moe}
  timeout -k 10 "${PMX_GPU_TESTS_TIMEOUT:-300}" $PY -m pytest -q -ra -p no:cacheprovider -n "${PMX_GPU_TEST_WORKERS:-8}" \
    --timeout 240 $tests -k "$kexpr" --junitxml "$OUT/junit.xml" 2>&1 | tee "$OUT/tests.log" | tail -60
  echo "tests: exit ${PIPESTATUS[0]}"
fi

if [[ $stage == all || $stage == bench ]]; then
  eval "extra=(${PMX_GPU_BENCH_ARGS:-})"
  timeout -k 10 "${PMX_GPU_BENCH_TIMEOUT:-300}" $PY benchmarks/gpu_generate.py --out_dir "$OUT" --vllm false "${extra[@]}" \
    2>"$OUT/bench.err" | tee "$OUT/bench.log"
  echo "bench: exit ${PIPESTATUS[0]}"
  tail -30 "$OUT/bench.err"
fi

if [[ $stage == profile ]]; then
  eval "extra=(${PMX_GPU_PROFILE_ARGS:-})"
  timeout -k 10 "${PMX_GPU_PROFILE_TIMEOUT:-240}" $PY benchmarks/gpu_profile.py "${extra[@]}" 2>&1 | tee "$OUT/profile.log" \
    | tail -60
  echo "profile: exit ${PIPESTATUS[0]}"
fi
