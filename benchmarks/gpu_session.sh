#!/usr/bin/env bash
# Issue 39's one prepared device run: everything a lent GPU machine is needed for, in one call of under 8 minutes,
# each stage under its own time limit, every figure written under $OUT. Without a GPU the same script rehearses
# itself: the CUDA parts skipped, everything else run (a small model on the CPU), so that the only thing the GPU run
# can find is the GPU.
#
#   bash benchmarks/gpu_session.sh prepare     here, once (needs PyPI): the wheels the device's image lacks into
#                                              .whl/, the real checkpoints (stories260k, tinystories-656k) into
#                                              .gpu_shared/models (both ignored by git, carried by the call)
#   bash benchmarks/gpu_session.sh rehearse    here: every stage on the CPU (4 to 7 min on 2 shared cores)
#   bash benchmarks/gpu_session.sh [all]       on the GPU machine (rehearses when no CUDA device is found)
#   bash benchmarks/gpu_session.sh STAGE...    some of: env decode serve gloo cpu tests (then report)
#
# The device tool's call, from a checkout holding this script after `prepare` (the machine has no registry):
#   run(command="bash benchmarks/gpu_session.sh", carry=[".whl", ".gpu_shared"], timeout_s=540)
# It returns $OUT/gpu-session-<gpu>-<date>.json (every figure, with GPU, driver, CUDA, torch, triton versions),
# $OUT/gpu-session-<gpu>-<date>.md (the tables, also printed last) and $OUT/logs.tar.gz (each stage's log, the
# GPU tests' junit XML, each stage's own JSON): copy the first two into benchmarks/results/.
#
# Stages (seconds: the limit of each; the budget is printed at the start and the time taken at the end):
#   env     20  versions, nvidia-smi, the host's processor, the stages' modules that do not import
#   decode 110  benchmarks/gpu_generate.py: Llama-2-7B shape float16 decode at batch 1 / 16 / 64 with
#               roofline_fraction, the decode fusions one by one, int8 / int4 (and GGUF's int8g32 / int4g32o) batch-1
#               ratios to float16, bfloat16, a 2048-token prefill against the dense float16 peak, transformers
#   serve  120  benchmarks/serve_bench.py sweep: the server on CUDA (random 7B weights, CUDA graphs, paged cache,
#               continuous batching) at 1 / 16 / 64 concurrent requests beside transformers (hf)
#   gloo    50  two ranks on one GPU over --comm_backend gloo: TP=1's greedy ids (tinystories-656k), and the 7B
#               shape's batch-1 decode at TP=1 and TP=2
#   cpu     60  benchmarks/cpu_peers.py on the host's processor (2 threads, base shape, fp32 and bf16 weights): the CPU
#               engine on an AVX-512 server's branches of its kernels (AVX512-BF16 / AMX where it has them)
#   tests  110  the GPU test set and the C++ CPU kernels' tests on pytest-xdist workers (PMX_GPU_TEST_WORKERS, default
#               12), last: the figures come first, and the tests find the Triton cache the benchmarks filled
#   report  10  the JSON and the Markdown under $OUT
# Environment: OUT (default out/gpu-session), PYTHON (default python3, or .venv/bin/python where there is one),
# PMX_GPU_TESTS / PMX_GPU_TESTS_K (the test files / -k expression), PMX_GPU_TEST_WORKERS.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out/gpu-session}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # the project uninstalled: scripts and test workers import runner
MODELS="stories260k tinystories-656k"                 # the real checkpoints the GPU tests and the gloo stage read
# the packages the stages import that the device's image lacks (KINDS.md lists what it has), at this venv's versions
WHEELS="fire==0.7.1 termcolor==3.3.0 starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 pydantic==2.14.4
pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 msgspec==0.22.0
sniffio==1.3.1"

if [[ ${1:-} == prepare ]]; then
  rm -rf .whl && mkdir -p .whl
  # shellcheck disable=SC2086
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl $WHEELS || exit 1
  mkdir -p .gpu_shared/models
  for m in $MODELS; do
    src=../shared/models/$m
    [ -d "$src" ] || { echo "prepare: $src not found (the GPU tests that read it will skip)"; continue; }
    rm -rf ".gpu_shared/models/$m" && cp -r "$src" ".gpu_shared/models/$m"
  done
  du -sh .whl .gpu_shared | tr '\n' ' '; echo "(carried by the call; the working tree travels too, 64 MiB in all)"
  ls .whl
  exit 0
fi

if compgen -G ".whl/*.whl" >/dev/null; then
  if $PY -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then  # the device's Python: the wheels are its
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/site" || echo "gpu_session.sh: the wheels in .whl did not install"
  else
    echo "gpu_session.sh: .whl holds the device's wheels (Python 3.12); $($PY --version 2>&1) uses its own packages"
  fi
fi
if [ -d .gpu_shared/models ] && [ ! -e ../shared ]; then ln -s "$ROOT/.gpu_shared" ../shared; fi

mode=gpu
if [[ ${1:-all} == rehearse ]] || ! $PY -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    2>/dev/null; then
  mode=rehearsal
fi
stages=("$@")
if [[ ${#stages[@]} -eq 0 || ${stages[0]} == all || ${stages[0]} == rehearse ]]; then
  stages=(env decode serve gloo cpu tests)   # the figures first; the tests find the Triton cache warm
fi
declare -A LIMIT=([env]=20 [decode]=110 [serve]=120 [gloo]=50 [cpu]=60 [tests]=110 [report]=10)
if [[ $mode == rehearsal ]]; then  # the CPU's stand-ins are slower than the GPU's figures (2 shared cores here)
  for s in "${!LIMIT[@]}"; do LIMIT[$s]=$((LIMIT[$s] * ${PMX_REHEARSAL_SCALE:-5})); done
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pmx-gpu-session.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
budget=${LIMIT[report]}
for s in "${stages[@]}"; do
  [[ -n ${LIMIT[$s]:-} ]] || { echo "gpu_session.sh: unknown stage $s (env decode serve gloo cpu tests)"; exit 2; }
  budget=$((budget + LIMIT[$s]))
done
echo "gpu_session.sh: $mode of stages ${stages[*]} report; budget $budget s; $($PY --version 2>&1); work $WORK"
T0=$(date +%s)

run_stage() {  # run_stage NAME CMD...: the command under the stage's limit, its log in WORK, a line in stages.tsv
  local name=$1; shift
  local t0 rc ms
  t0=$(date +%s%N)
  echo "== $name (limit ${LIMIT[$name]} s): $*"
  timeout -k 10 "${LIMIT[$name]}" "$@" >"$WORK/$name.log" 2>&1
  rc=$?
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  printf '%s\t%s\t%d.%03d\t%s\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) "${LIMIT[$name]}" >>"$WORK/stages.tsv"
  tail -n 15 "$WORK/$name.log"
  echo "== $name: exit $rc after $((ms / 1000)) s$([ "$rc" = 124 ] && echo ' (TIMED OUT)')"
}

# the GPU test set: every test that runs on CUDA when it is there (the multi-rank launches written for the CPU are
# left out: with --device auto they would ask NCCL for two ranks on the one GPU, which is refused)
TESTS=${PMX_GPU_TESTS:-tests/test_triton_kernels.py tests/test_cuda_graphs.py tests/test_gpu_tp.py \
tests/test_gpu_generate.py tests/test_quant_engine.py tests/test_kernels.py tests/test_fused_decode.py \
tests/test_torch_ops.py}  # (the last three: the C++ CPU kernels, on the host's processor)
TESTS_K=${PMX_GPU_TESTS_K:-not tensor_parallel and not dump_and_replay and not quantized_moe}
tests_stage() {
  local xdist=() timeouts=()
  if $PY -c 'import xdist' 2>/dev/null; then xdist=(-n "${PMX_GPU_TEST_WORKERS:-12}"); fi
  if $PY -c 'import pytest_timeout' 2>/dev/null; then timeouts=(--timeout 120); fi
  [[ ${#xdist[@]} -gt 0 ]] || echo "tests: pytest-xdist not importable: one worker"
  if [[ $mode == gpu ]]; then
    # shellcheck disable=SC2086
    $PY -m pytest -v -ra -p no:cacheprovider "${xdist[@]}" "${timeouts[@]}" $TESTS -k "$TESTS_K" \
      --junitxml "$WORK/junit.xml"   # (-v: a line per test as it ends, which a run cut short keeps)
  else  # the set must import and select tests (two workers collecting); it runs on the GPU
    [[ ${#xdist[@]} -eq 0 ]] || xdist=(-n 2)
    # shellcheck disable=SC2086
    $PY -m pytest -q -p no:cacheprovider "${xdist[@]}" "${timeouts[@]}" $TESTS -k "$TESTS_K" --collect-only \
      | tee "$WORK/collected.txt" | tail -n 3
    grep -q "tests collected\|selected" "$WORK/collected.txt"
  fi
}

for s in "${stages[@]}"; do
  case $s in
    env) run_stage env $PY benchmarks/gpu_session.py env --json_path "$WORK/env.json"
         { nvidia-smi 2>&1 || echo "nvidia-smi: not here"; } >"$WORK/nvidia-smi.txt" ;;
    tests) export -f tests_stage; export PY TESTS TESTS_K mode WORK
           run_stage tests bash -c tests_stage ;;
    decode)
      if [[ $mode == gpu ]]; then
        run_stage decode $PY benchmarks/gpu_generate.py --batches "1 16 64" --gen_len 64 --hf_batches 1 \
          --prefill_len 2048 --json_path "$WORK/decode.json"
      else
        run_stage decode $PY benchmarks/gpu_generate.py --device cpu --shape tiny --batches "1 4" --gen_len 8 \
          --hf_batches 1 --prefill_len 256 --json_path "$WORK/decode.json"
      fi ;;
    serve)
      if [[ $mode == gpu ]]; then shape=7b dev=cuda conc=1,16,64 lens=(--input_len 128 --output_len 64)
      else shape=tiny dev=cpu conc=1,4 lens=(--input_len 16 --output_len 8); fi
      $PY benchmarks/gpu_session.py serve_model --output_dir "$WORK/serve_model" --shape $shape >/dev/null
      run_stage serve $PY benchmarks/serve_bench.py sweep --model "$WORK/serve_model" --systems pmx1,hf \
        --concurrency $conc --rounds 1 "${lens[@]}" --device $dev --random_weights true \
        --workdir "$WORK/serve_work" --json_path "$WORK/serve.json" ;;
    gloo)
      model=../shared/models/tinystories-656k
      [ -d $model ] || model=../shared/models/stories260k
      if [[ $mode == gpu ]]; then dev=cuda shape=7b; else dev=cpu shape=tiny; fi
      run_stage gloo $PY benchmarks/gpu_session.py gloo --model $model --device $dev --bench_shape $shape \
        --json_path "$WORK/gloo.json" ;;
    cpu)  # the CPU engine on the host's processor (a GPU machine's is an AVX-512 server's: its kernels' branches)
      run_stage cpu $PY benchmarks/cpu_peers.py --shape base --rounds 2 --systems pmx1,pmx1-bf16 --threads 2 \
        --decode_tokens 32 --workdir "$WORK/cpu_work" --json_path "$WORK/cpu.json" ;;
  esac
done
run_stage report $PY benchmarks/gpu_session.py report --work "$WORK" --out_dir "$OUT"
tar czf "$OUT/logs.tar.gz" -C "$WORK" --exclude serve_model --exclude serve_work --exclude cpu_work .
echo "gpu_session.sh: $mode done in $(( $(date +%s) - T0 )) s of $budget s budgeted; under $OUT:" $(ls "$OUT")
tail -n +1 "$WORK/report.log" | sed -n '/^# GPU session/,$p'
