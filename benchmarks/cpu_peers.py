#!/usr/bin/env python3
"""CPU generation speed of pmx-runner beside its peers: the same random-weight HF Llama, the same threads.

Systems (`--systems`, comma-separated; default all):
  pmx1          pmx-runner TP=1: one process, THREADS threads (open_session + Generator.generate)
  pmx2          pmx-runner TP=2: scripts/mpirun.sh -np 2, THREADS/2 threads per rank
  transformers  AutoModelForCausalLM, fp32, torch.set_num_threads(THREADS), greedy generate
  ct2           CTranslate2 float32, Generator(intra_threads=THREADS, inter_threads=1)
  llama.cpp     F32 GGUF: llama-bench (batch 1, prefill) and llama-batched-bench (batch 16), -t THREADS
  openvino      OpenVINO GenAI, fp32 weights, INFERENCE_PRECISION_HINT f32  } each in a venv of its own
  vllm          vLLM CPU, dtype float32                                      } (benchmarks/peer_venvs.py, torch
  ortgenai      ONNX Runtime GenAI, its builder's -p fp32 -e cpu model         } pinned to 2.13.0)
Half-precision weights (the bfloat16 copy of the checkpoint, hf-bf16: the same weights rounded):
  pmx1-bf16 / pmx2-bf16   pmx-runner on it (--dtype auto: float32 compute, linear weights kept in bfloat16)
  llama.cpp-bf16          convert_hf_to_gguf.py --outtype bf16
  openvino-bf16           optimum-cli --weight-format fp16, INFERENCE_PRECISION_HINT bf16 (f32 on a CPU without
                          bfloat16 arithmetic)
  vllm-bf16               vLLM CPU, dtype bfloat16
Weight-only quantised, the same weights (each quantised by its own tool, lm head included):
  pmx1-int8 / pmx1-int4    pmx-runner TP=1 on `python -m runner quantize --quantize int8|int4` (lm head and embedding
                           quantised too, the default)
  pmx2-int8 / pmx2-int4    the same at TP=2
  ct2-int8                 CTranslate2 with ct2-transformers-converter --quantization int8
  llama.cpp-q8_0 / -q4_0   llama-quantize of the F32 GGUF to Q8_0 / Q4_0 (its default: Q4_0 keeps a Q6_K lm head)
Metrics: decode tokens/s at batch 1 and 16 after an 8-token prompt (prefill time excluded) and prefill
tokens/s of one 512-token prompt. Every round runs each system once, in its own subprocess, in a
rotated order; the table gives medians over the rounds and the JSON every raw number (and the best
round, the least disturbed on a shared box), the versions, thread counts, model shape and the 1-minute
load average at start and end. Each round also measures the bytes per second the box reads (2 threads summing 1 GiB,
best of 5), and the tables give batch-1 decode's weight bytes per second beside it; float32, half-precision and
quantised systems are printed in tables of their own. About 2 minutes a round for base on 2 cores, plus one-off
conversions.

    python benchmarks/cpu_peers.py [--shape base|gqa] [--rounds 5] [--threads 2] [--decode_tokens 32]
        [--systems pmx1,pmx2,transformers,ct2,llama.cpp] [--engine_options '{"prepack": false}']
        [--json_path out/cpu_peers_SHAPE.json] [--workdir ~/.cache/pmx-runner/peers] [--llama_cpp DIR] [--install True]
    python benchmarks/cpu_peers.py paired [--shape base|gqa] [--pmx pmx1|pmx1-int8|pmx1-int4]
        [--peer llama.cpp|llama.cpp-q8_0|llama.cpp-q4_0|ct2|ct2-int8] [--point decode_b1|prefill_512] [--pairs 12]
    python benchmarks/cpu_peers.py tp_paired [--shape gqa|base] [--pairs 12] [--quant int8|int4]
    python benchmarks/cpu_peers.py versions --base BEFORE_TREE [--shape gqa|base|all] [--tp 1,2] [--quant none,int8]
        [--pairs 12] [--metrics decode_b1,decode_b16,prefill_512,mixed] [--json_path out/versions_SHAPE.json]
    python benchmarks/cpu_peers.py quant_ends [--shape gqa|base] [--quant int8|int4] [--pairs 12]

`quant_ends` pairs the same way pmx-runner TP=1 on the default int8 / int4 model (output and embedding quantised)
against one whose output and embedding stay float (`--quantize_output False --quantize_embedding False`).

`paired` measures batch-1 decode (or a 512-token prefill) of pmx-runner TP=1 and one peer in alternating slices of
a few seconds and reports the median of the per-pair ratios: on a box whose memory bandwidth swings between rounds, this
resolves differences of a few percent that round medians cannot. `tp_paired` does the same for pmx-runner TP=2
against TP=1 at every point (decode batch 1 and 16, prefill 512): both jobs stay loaded and take turns.

`versions` does the same for two versions of pmx-runner (a before/after check of a change): the code in BEFORE_TREE
(a checkout, e.g. `git worktree add --detach /work/baseline main`) against this checkout, at every point and for
each shape, TP (1: one process, THREADS threads; 2: mpirun, THREADS/2 a rank) and weights (fp32, int8) asked for,
both jobs on the same model files. Each job imports `runner` from its own tree (PYTHONPATH and cwd set to the tree;
every rank's runner.__file__ is checked and recorded) and builds the C++ extension into a directory of its own
(~/.cache/pmx-runner/ext-before, ext-after). Point `mixed` is benchmarks/cpu_step.py's mixed step (64 sequences
decoding after 64 tokens of history and one 512-token prompt chunk, one step through the ppl.pmx step contract) and
the same two apart, taking turns step by step (3 of each a slice; cache rows STEP_ROWS apart). It prints per point
the median of the per-pair after / before ratios of tokens/s (above 1: after is faster), their geometric mean and
range; for `mixed` the ratio of the mixed step's time (below 1: faster) and each tree's mixed / apart (the per-pair
lines on stderr give tokens/s throughout; mixed: 576 tokens over its step time); at the end one markdown table of
every configuration and which of issue 24's marks were missed. Other users' processes disturb it: one that keeps a
core busy slows TP=1 (two OpenMP threads, one sharing its core) several times over, and the two slices of a pair
unequally. So every slice also measures the cores everything else kept busy meanwhile (/proc, CPU seconds a second);
a pair where either slice saw more than BUSY_CORES is not quiet, and per point the count of quiet pairs and their
median ratio are printed too (the headline medians are over all pairs). The JSON (written after each configuration)
holds every raw figure, both trees' `git describe`, the CPU, thread counts, load averages and the other processes'
cores of each slice. The engine's API is known in one place, open_engine, which finds the API of the `runner` it
imports.

One shape per invocation (base: dim 768, 12 layers, 12 heads MHA, intermediate 2048, vocab 32000;
gqa: dim 1024, 10 layers, 16 heads / 4 KV heads, intermediate 2816, vocab 32000); run it twice for
both (versions: `--shape all`). `--engine_options` is a JSON object of engine option fields
(runner.engine.model.EngineOptions), passed to open_session through open_engine in every pmx run, over a default of
cache_layout 2 (the layout the LLM API and the server use). Checkpoints and conversions are cached under --workdir.

A missing peer is skipped with a one-line reason. With `--install True` (the default) a missing
ctranslate2 is installed into this venv (`python -m pip install ctranslate2`). llama.cpp comes from
the llama-cpp-python sdist (pinned below) and is built once into ~/.cache/pmx-runner/llama.cpp
(about 15 minutes on 2 cores); `--llama_cpp DIR` or PMX_LLAMA_CPP=DIR points at an existing build
(a directory holding llama-bench and llama-batched-bench, or its bin/). The build, by hand:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d SDIST && tar xzf SDIST/*.tar.gz
    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    cmake --build build --target llama-bench llama-batched-bench -j2   # (serve_bench.py: llama-server)

The GGUF is made by the sdist's convert_hf_to_gguf.py --outtype f32 (its gguf-py on PYTHONPATH) from a
copy of the checkpoint (weights linked) that holds a small sentencepiece tokenizer.model: the converter
refuses the random model's byte-level BPE tokenizer.json ("BPE pre-tokenizer was not recognized"); it
pads the vocabulary to the model's 32000 rows. llama.cpp keeps its default f16 KV cache (llama-bench
takes no f32 cache type); the others cache in fp32. ct2-transformers-converter writes null bos/eos tokens
for this tokenizer, which ctranslate2 cannot load, so <s>, </s>, <unk> are set in its config.json.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import fire

SELF = Path(__file__).resolve()
REPO = SELF.parent.parent
CACHE = Path.home() / ".cache" / "pmx-runner"
LLAMA_CPP_PYTHON = "0.3.36"  # the sdist that ships llama.cpp's source
SHAPES = {"base": dict(hidden_dim=768, intermediate_dim=2048, num_layers=12, num_heads=12, num_kv_heads=12,
                       vocab_size=32000),
          "gqa": dict(hidden_dim=1024, intermediate_dim=2816, num_layers=10, num_heads=16, num_kv_heads=4,
                      vocab_size=32000)}
LABELS = {"pmx1": "pmx-runner TP=1", "pmx2": "pmx-runner TP=2", "transformers": "transformers",
          "ct2": "CTranslate2", "llama.cpp": "llama.cpp", "openvino": "OpenVINO GenAI", "vllm": "vLLM CPU",
          "ortgenai": "ONNX Runtime GenAI",
          "pmx1-bf16": "pmx-runner TP=1 bf16", "pmx2-bf16": "pmx-runner TP=2 bf16", "llama.cpp-bf16": "llama.cpp BF16",
          "read": "the box's read",
          "openvino-bf16": "OpenVINO GenAI fp16 (bf16 hint)", "vllm-bf16": "vLLM CPU bf16",
          "pmx1-int8": "pmx-runner TP=1 int8", "pmx1-int4": "pmx-runner TP=1 int4",
          "pmx2-int8": "pmx-runner TP=2 int8", "pmx2-int4": "pmx-runner TP=2 int4", "ct2-int8": "CTranslate2 int8",
          "llama.cpp-q8_0": "llama.cpp Q8_0", "llama.cpp-q4_0": "llama.cpp Q4_0"}
METRICS = ("decode_b1", "decode_b16", "prefill_512")
HALF = {"pmx1-bf16", "pmx2-bf16", "llama.cpp-bf16", "openvino-bf16", "vllm-bf16"}  # half-precision weights
VENV_PEERS = {"openvino", "openvino-bf16", "vllm", "vllm-bf16", "ortgenai"}  # benchmarks/peer_venvs.py
PROMPT, LONG_PROMPT = 8, 512


class Skip(Exception):
    """A peer that cannot be measured here; the message says why."""


def _run(cmd, what: str, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if res.returncode != 0:
        last = (res.stderr.strip() or res.stdout.strip() or "no output").splitlines()[-1]
        raise Skip(f"{what} failed (exit {res.returncode}): {last}")
    return res


# ---- in-process measurement, shared by the python systems (each runs in its own worker process) ----

def _prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    import torch
    g = torch.Generator().manual_seed(seed + batch * 1000 + length)
    return [torch.randint(3, 32000, (length,), generator=g).tolist() for _ in range(batch)]


def _measure(generate, decode_tokens: int) -> dict:
    """`generate(prompts, n)` makes n new tokens per prompt. Decode = (time for n+1 - time for 1) / n."""
    def timed(prompts, n):
        t0 = time.perf_counter()
        generate(prompts, n)
        return time.perf_counter() - t0
    res = {}
    for b in (1, 16):
        prompts = _prompts(b, PROMPT)
        generate(prompts, 4)  # warm-up
        t_prefill = timed(prompts, 1)
        res[f"decode_b{b}"] = b * decode_tokens / (timed(prompts, decode_tokens + 1) - t_prefill)
    long = _prompts(1, LONG_PROMPT)
    generate(long, 1)
    res["prefill_512"] = LONG_PROMPT / timed(long, 1)
    return res


def _engine_options(opts) -> dict:
    """A JSON string, or the dict fire made of it (where JSON's true/false/null arrive as strings)."""
    if isinstance(opts, str):
        return json.loads(opts)
    return {k: {"true": True, "false": False, "null": None}.get(v, v) if isinstance(v, str) else v
            for k, v in dict(opts).items()}


def open_engine(model: str, engine_options="{}") -> SimpleNamespace:
    """This rank's pmx-runner engine on `model`, behind one face whatever the engine API of the `runner` imported:
    the one place that knows that API (issue 24 moves it; fix it here). `engine_options`: JSON or a dict of the
    engine option fields (the same names in both APIs). The face: generate(prompts, n) -> the generated id lists;
    forward(**ppl.pmx step inputs, kv_cache=, kv_scale=) -> logits (benchmarks/cpu_step.py); new_cache(rows) ->
    (kv_cache, kv_scale); vocab_size; is_main; close(); api (which API was found) and runner (runner.__file__)."""
    import runner
    from runner.engine.session import open_session
    # the KV cache in layout 2 (a layer's rows of consecutive positions adjacent), as the LLM API and the server run
    # it (runner.config.serving_config), in offset mode so that cpu_step.py's ppl.pmx step inputs stay valid; ppl.pmx's
    # layout 0 (Demo's default) puts a token's rows of one layer 2 L rows apart: batch-1 decode of the base shape ran
    # 1.11x faster in layout 2 (per-pair median, Zen 5, bf16)
    opts = {"cache_layout": 2, **_engine_options(engine_options)}
    try:
        from runner.config import EngineConfig  # issue 24: one engine core
    except ImportError:
        EngineConfig = None
    if EngineConfig is not None:
        sess = open_session(model, EngineConfig(**opts))
        core = sess.core if hasattr(sess, "core") else sess.engine  # (Session.engine in trees before issue 37)
        generate, stepper = core.generate, sess.stepper
    else:  # before issue 24 (5ae015a and earlier)
        from runner.engine.generator import Generator
        from runner.engine.model import EngineOptions
        sess = open_session(model, options=EngineOptions(**opts))
        generate, stepper = (lambda p, n: Generator(sess.model).generate(p, n)), sess.model
    return SimpleNamespace(api="EngineConfig" if EngineConfig else "EngineOptions", runner=runner.__file__,
                           generate=generate, forward=stepper.forward, new_cache=sess.model.new_cache,
                           vocab_size=json.loads((Path(model) / "pmx_params.json").read_text())["vocab_size"],
                           is_main=sess.is_main, close=sess.close)


def _pmx_numbers(model: str, decode_tokens: int, engine_options: str) -> dict:
    import torch
    eng = open_engine(model, engine_options)
    res = _measure(eng.generate, decode_tokens)
    res["threads"] = torch.get_num_threads()
    eng.close()
    return res if eng.is_main else {}


def _transformers_numbers(model: str, decode_tokens: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        res = _measure(lambda p, n: hf.generate(torch.tensor(p), max_new_tokens=n, min_new_tokens=n, **kw),
                       decode_tokens)
    return {**res, "threads": torch.get_num_threads()}


def _ct2_numbers(model: str, decode_tokens: int, threads: int) -> dict:
    import ctranslate2
    gen = ctranslate2.Generator(model, device="cpu", intra_threads=threads, inter_threads=1)
    vocab = json.loads((Path(model) / "vocabulary.json").read_text())
    res = _measure(lambda p, n: gen.generate_batch([[vocab[i] for i in x] for x in p], max_length=n, min_length=n,
                                                   include_prompt_in_result=False), decode_tokens)
    return {**res, "threads": threads}


def worker(system: str, model: str, out: str, decode_tokens: int = 32, threads: int = 2,
           engine_options: str = "{}") -> None:
    """One measurement of one system (run by main in a subprocess; pmx under mpirun on every rank)."""
    if system == "pmx":
        res = _pmx_numbers(model, decode_tokens, engine_options)
    elif system == "read":
        res = {"read_gbps": _read_bandwidth(threads), "threads": threads}
    elif system in VENV_PEERS:  # (run by the peer environment's Python)
        import peer_venvs
        gen, info = peer_venvs.generator(system, model, threads)
        res = {**_measure(gen, decode_tokens), "threads": threads, "peer": info}
    else:
        res = {"transformers": _transformers_numbers, "ct2": _ct2_numbers}[system](model, decode_tokens, threads)
    if res:
        Path(out).write_text(json.dumps(res))


# ---- preparation: checkpoints, conversions, peers; each returns a function measuring one round ----

def _read_bandwidth(threads: int, gib: int = 1, reps: int = 5) -> float:
    """The bytes per second this box reads with `threads` threads: the best of `reps` sums of a `gib` GiB float32
    array (torch's vectorised reduction, one pass over memory; far larger than the caches)."""
    import torch
    torch.set_num_threads(threads)
    x = torch.ones(gib << 28)
    best = 0.0
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t0))
    return best / 1e9


def _sustained_read(threads: int, seconds: float = 1.0, gib: int = 1) -> float:
    """The bytes per second this box reads with `threads` threads, held for `seconds` (as long as a decode slice): sums
    of a `gib` GiB float32 array one after another, all their bytes over all their time (GB/s)."""
    import torch
    torch.set_num_threads(threads)
    x = torch.ones(gib << 28)
    x.sum()
    n, t0 = 0, time.perf_counter()
    while n == 0 or time.perf_counter() - t0 < seconds:
        x.sum()
        n += 1
    return n * x.numel() * 4 / (time.perf_counter() - t0) / 1e9


def _worker_round(cmd_head: list, system: str, model: Path, a: dict, env_threads: int, python=None,
                  env: dict | None = None):
    def run() -> dict:
        out = a["work"] / f"{system}.result.json"
        out.unlink(missing_ok=True)
        cmd = cmd_head + [python or sys.executable, SELF, "worker", system, "--model", model, "--out", out,
                          "--decode_tokens", a["decode_tokens"], "--threads", a["threads"],
                          "--engine_options", json.dumps(a["engine_options"])]
        _run(cmd, f"{system} worker", env={**os.environ, "OMP_NUM_THREADS": str(env_threads), **(env or {})},
             cwd=REPO)
        res = json.loads(out.read_text())
        out.unlink()
        return res
    run.python, run.model = python or sys.executable, model
    return run


def _pmx_model(n: int, a: dict, quant: str | None = None) -> Path:
    """The HF checkpoint converted for n ranks: quantised (quant int8 / int4), or quant "bf16": the bfloat16
    checkpoint (hf_bf16: the same weights rounded) as it is."""
    from runner.pmx.convert import convert
    from runner.pmx.quant import scheme_from_flags
    half = quant == "bf16"
    pmx, scheme = a["work"] / (f"pmx{n}-{quant}" if quant else f"pmx{n}"), scheme_from_flags(None if half else quant)
    params = pmx / "pmx_params.json"  # a cached conversion of another scheme (older defaults) is made again
    if not params.exists() or json.loads(params.read_text()).get("quantization") != (scheme and scheme.to_dict()):
        convert(str(hf_bf16(a) if half else a["hf"]), str(pmx), num_shards=n, overwrite=True, progress=False,
                quant=scheme)
    return pmx


def hf_bf16(a: dict) -> Path:
    """The bfloat16 copy of the shape's random checkpoint (make_random_model with the same seed: the float32 weights
    rounded), made once beside it."""
    from runner.pmx.random_model import make_random_model
    out = a["work"] / "hf-bf16"
    if not (out / "config.json").exists():
        make_random_model(str(out), **SHAPES[a["work"].name], dtype="bfloat16", overwrite=True)
    return out


def _prepare_pmx(n: int, a: dict, quant: str | None = None):
    pmx = _pmx_model(n, a, quant)
    head = [REPO / "scripts" / "mpirun.sh", "-np", n] if n > 1 else []
    return _worker_round(head, "pmx", pmx, a, max(1, a["threads"] // n))


def _pip_install(package: str, module: str, a: dict) -> None:
    try:
        __import__(module)
        return
    except ImportError:
        pass
    cmd = f"{sys.executable} -m pip install {package}"
    if not a["install"]:
        raise Skip(f"{package} is not installed; run: {cmd}")
    print(f"installing: {cmd}", file=sys.stderr)
    _run(cmd.split(), f"pip install {package}")


def _prepare_venv_peer(system: str, a: dict):
    """A peer of benchmarks/peer_venvs.py: its environment, its conversion (fp32 from hf; the half-precision ones from
    hf_bf16, the same weights rounded), and its worker run by its environment's Python."""
    import peer_venvs
    half = system in HALF
    if system.startswith("openvino"):
        py, model = peer_venvs.openvino_model(a["work"], hf_bf16(a) if half else a["hf"], "fp16" if half else "fp32",
                                             a["install"])
    elif system == "ortgenai":
        py, model = peer_venvs.ortgenai_model(a["work"], a["hf"], a["install"], a["threads"])
    else:
        py, model = peer_venvs.peer_python(a["work"], "vllm", a["install"]), hf_bf16(a) if half else a["hf"]
    return _worker_round([], system, model, a, a["threads"], python=py, env=peer_venvs.peer_env(system, a["threads"]))


def _prepare_ct2(a: dict, quant: str = "float32"):
    return _worker_round([], "ct2", _ct2_model(a, quant), a, a["threads"])


def _ct2_model(a: dict, quant: str = "float32") -> Path:
    _pip_install("ctranslate2", "ctranslate2", a)
    out = a["work"] / ("ct2-f32" if quant == "float32" else f"ct2-{quant}")
    if not (out / "model.bin").exists():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        _run([Path(sys.executable).parent / "ct2-transformers-converter", "--model", a["hf"], "--output_dir", tmp,
              "--quantization", quant], "ct2-transformers-converter")
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.update(bos_token="<s>", eos_token="</s>", unk_token="<unk>")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tmp.rename(out)
    return out


def _llama_cpp_source() -> Path:
    root = CACHE / "llama.cpp"
    src = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    if not (src / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").exists():
        print(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist into {root}", file=sys.stderr)
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", root / "sdist"], "pip download llama-cpp-python")
        _run(["tar", "xzf", root / "sdist" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz", "-C", root], "tar")
    return src


BENCH_TOOLS = ("llama-bench", "llama-batched-bench")


def _llama_cpp_bin(src: Path, given: str | None, tools: tuple = BENCH_TOOLS) -> Path:
    """The bin directory of a llama.cpp build holding `tools` (`given`, or CACHE/llama.cpp/build, built there once
    with the server configured too, so benchmarks/serve_bench.py's llama-server comes from the same build)."""
    if given:
        for d in (Path(given), Path(given) / "bin"):
            if all((d / t).is_file() for t in tools):
                return d
        raise Skip(f"{given} holds no {' and '.join(tools)}")
    build = CACHE / "llama.cpp" / "build"
    if not all((build / "bin" / t).is_file() for t in tools):
        if not shutil.which("cmake"):
            raise Skip("no llama.cpp build: cmake is not installed (apt-get install cmake g++) and no --llama_cpp DIR")
        log = CACHE / "llama.cpp" / "build.log"
        print(f"building llama.cpp once into {build} (about 15 min on 2 cores; log {log})", file=sys.stderr)
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_APP=OFF",
                 "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
        with open(log, "w") as f:
            for cmd in (["cmake", "-S", src / "vendor" / "llama.cpp", "-B", build, *flags],
                        ["cmake", "--build", build, "--target", *tools, "-j", str(os.cpu_count() or 2)]):
                if subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT).returncode:
                    raise Skip(f"llama.cpp build failed, see {log}")
    return build / "bin"


def _sentencepiece_model(path: Path) -> None:
    """A small sentencepiece BPE tokenizer.model (byte fallback), which convert_hf_to_gguf.py accepts."""
    import io
    import sentencepiece as spm
    from runner.pmx.random_model import CORPUS
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS.split(". ") * 4), model_writer=buf,
                                   vocab_size=400, model_type="bpe", byte_fallback=True, hard_vocab_limit=False,
                                   minloglevel=2)
    path.write_bytes(buf.getvalue())


def _llama_cpp_model(a: dict, quant: str | None = None, tools: tuple = BENCH_TOOLS) -> tuple[Path, Path]:
    """(llama.cpp's bin dir holding `tools`, the GGUF): built, converted and quantised once, then cached. quant "bf16":
    the bfloat16 checkpoint converted with --outtype bf16."""
    src = _llama_cpp_source()
    half = quant == "bf16"
    bindir = _llama_cpp_bin(src, a["llama_cpp"], tools + (("llama-quantize",) if quant and not half else ()))
    gguf = a["work"] / ("model-bf16.gguf" if half else "model-f32.gguf")
    if not gguf.exists():
        copy = a["work"] / ("gguf-src-bf16" if half else "gguf-src")
        shutil.rmtree(copy, ignore_errors=True)
        copy.mkdir()
        for f in ("config.json", "model.safetensors"):
            (copy / f).symlink_to((hf_bf16(a) if half else a["hf"]) / f)
        _sentencepiece_model(copy / "tokenizer.model")
        lcpp = src / "vendor" / "llama.cpp"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(lcpp / "gguf-py"),
                                                                         os.environ.get("PYTHONPATH")]))}
        _run([sys.executable, lcpp / "convert_hf_to_gguf.py", copy, "--outtype", "bf16" if half else "f32",
              "--outfile", gguf.with_suffix(".tmp")], "convert_hf_to_gguf.py", env=env)
        gguf.with_suffix(".tmp").rename(gguf)
    if quant and not half:
        qgguf = a["work"] / f"model-{quant}.gguf"
        if not qgguf.exists():
            _run([bindir / "llama-quantize", gguf, qgguf.with_suffix(".tmp"), quant.upper(), a["threads"]],
                 "llama-quantize")
            qgguf.with_suffix(".tmp").rename(qgguf)
        gguf = qgguf
    return bindir, gguf


def _prepare_llama_cpp(a: dict, quant: str | None = None):
    bindir, gguf = _llama_cpp_model(a, quant)
    t, n = str(a["threads"]), str(a["decode_tokens"])
    bench = partial(_llama_bench, bindir, gguf, t)

    def run() -> dict:
        tg = bench("-p", "0", "-n", n, "-d", str(PROMPT))
        pp = bench("-p", str(LONG_PROMPT), "-n", "0")
        out = _run([bindir / "llama-batched-bench", "-m", gguf, "-c", "4096", "-npp", str(PROMPT), "-ntg", n,
                    "-npl", "16", "-t", t, "--output-format", "jsonl"], "llama-batched-bench")
        bb = [json.loads(line) for line in (out.stdout + out.stderr).splitlines() if '"speed_tg"' in line][0]
        a["llama_cpp_run"] = {k: tg.get(k) for k in ("build_commit", "build_number", "model_type", "model_n_params",
                                                     "type_k", "type_v", "flash_attn", "n_batch", "n_ubatch")}
        return {"decode_b1": tg["avg_ts"], "decode_b16": bb["speed_tg"], "prefill_512": pp["avg_ts"],
                "threads": tg["n_threads"]}
    return run


def _batched_bench(bindir: Path, gguf: Path, threads: str, n: str) -> float:
    """llama-batched-bench's decode tokens/s of 16 sequences making n tokens each after PROMPT-token prompts."""
    out = _run([bindir / "llama-batched-bench", "-m", gguf, "-c", "4096", "-npp", str(PROMPT), "-ntg", n, "-npl", "16",
                "-t", threads, "--output-format", "jsonl"], "llama-batched-bench")
    return [json.loads(line) for line in (out.stdout + out.stderr).splitlines() if '"speed_tg"' in line][0]["speed_tg"]


def _llama_bench(bindir: Path, gguf: Path, threads: str, *args) -> dict:
    return json.loads(_run([bindir / "llama-bench", "-m", gguf, "-t", threads, "-r", "1", "-o", "json", *args],
                           "llama-bench").stdout)[0]


def _versions(a: dict) -> dict:
    def v(pkg):
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None
    git = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True)
    changelog = CACHE / "llama.cpp" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "CHANGELOG.md"
    commit = None
    if changelog.exists():  # "## [0.3.36]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098"
        section = changelog.read_text().split(f"## [{LLAMA_CPP_PYTHON}]", 1)[-1]
        commit = next((w.split("@")[1] for w in section.split() if "llama.cpp@" in w), None)
    return {"python": platform.python_version(), "pmx-runner": git.stdout.strip(), "torch": v("torch"),
            "transformers": v("transformers"), "ctranslate2": v("ctranslate2"), "mpi4py": v("mpi4py"),
            "llama.cpp": {"llama-cpp-python sdist": LLAMA_CPP_PYTHON, "commit (sdist changelog)": commit,
                          **a.get("llama_cpp_run", {})}}


def main(shape: str = "base", rounds: int = 5, threads: int = 2, decode_tokens: int = 32,
         systems: str = "pmx1,pmx2,transformers,ct2,llama.cpp", engine_options="{}", json_path: str | None = None,
         workdir: str = str(CACHE / "peers"), llama_cpp: str | None = None, install: bool = True) -> None:
    from runner.pmx.random_model import make_random_model
    if shape not in SHAPES:
        raise SystemExit(f"--shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    chosen = systems.split(",") if isinstance(systems, str) else list(systems)
    if set(chosen) - set(LABELS):
        raise SystemExit(f"--systems: unknown {sorted(set(chosen) - set(LABELS))}; known: {', '.join(LABELS)}")
    work = Path(workdir).expanduser() / shape
    hf = work / "hf"
    if not (hf / "config.json").exists():
        make_random_model(str(hf), **SHAPES[shape], overwrite=True)
    a = dict(work=work, hf=hf, threads=threads, decode_tokens=decode_tokens, install=install,
             engine_options=_engine_options(engine_options), llama_cpp=llama_cpp or os.environ.get("PMX_LLAMA_CPP"))
    prepare = {"pmx1": lambda: _prepare_pmx(1, a), "pmx2": lambda: _prepare_pmx(2, a),
               "transformers": lambda: _worker_round([], "transformers", hf, a, threads),
               "ct2": lambda: _prepare_ct2(a), "llama.cpp": lambda: _prepare_llama_cpp(a),
               "ct2-int8": lambda: _prepare_ct2(a, "int8"),
               "llama.cpp-q8_0": lambda: _prepare_llama_cpp(a, "q8_0"),
               "llama.cpp-q4_0": lambda: _prepare_llama_cpp(a, "q4_0")}
    for n, q in ((1, "int8"), (1, "int4"), (2, "int8"), (2, "int4"), (1, "bf16"), (2, "bf16")):
        prepare[f"pmx{n}-{q}"] = (lambda n, q: lambda: _prepare_pmx(n, a, q))(n, q)
    prepare["llama.cpp-bf16"] = lambda: _prepare_llama_cpp(a, "bf16")
    for s in VENV_PEERS:
        prepare[s] = (lambda s: lambda: _prepare_venv_peer(s, a))(s)
    ready, skipped = {}, {}
    for s in chosen:
        try:
            ready[s] = prepare[s]()
        except Exception as e:  # noqa: BLE001 - a peer that cannot be set up is skipped, the rest still run
            skipped[s] = str(e) if isinstance(e, Skip) else f"{type(e).__name__}: {e}"
    load_start = os.getloadavg()[0]
    raw = {s: [] for s in ready}
    read = _worker_round([], "read", hf, a, threads)  # the box's read bandwidth, once a round
    reads = []
    t_start = time.time()
    for r in range(rounds):
        reads.append(read()["read_gbps"])
        print(f"round {r + 1}/{rounds} read bandwidth: {reads[-1]:.1f} GB/s", file=sys.stderr, flush=True)
        order = list(ready)[r % max(len(ready), 1):] + list(ready)[:r % max(len(ready), 1)]
        for s in order:
            if s in skipped:
                continue
            try:
                res = ready[s]()
            except Exception as e:  # noqa: BLE001
                skipped[s] = f"round {r + 1}: {e if isinstance(e, Skip) else f'{type(e).__name__}: {e}'}"
                continue
            raw[s].append({**res, "round": r + 1, "loadavg_1m": os.getloadavg()[0]})
            print(f"round {r + 1}/{rounds} {LABELS[s]}: " + ", ".join(f"{m} {res[m]:.1f}" for m in METRICS),
                  file=sys.stderr, flush=True)
    load_end = os.getloadavg()[0]
    med = {s: {m: statistics.median(x[m] for x in raw[s]) for m in METRICS} for s in ready if s not in skipped}
    th = {s: (raw[s][0].get("threads", threads) if not s.startswith("pmx2") else f"2x{raw[s][0].get('threads')}")
          for s in med}

    p = SHAPES[shape]
    read_gbps = statistics.median(reads) if reads else float("nan")
    print(f"\nshape {shape}: dim {p['hidden_dim']}, {p['num_layers']} layers, {p['num_heads']} heads / "
          f"{p['num_kv_heads']} KV, intermediate {p['intermediate_dim']}, vocab {p['vocab_size']}; "
          f"{rounds} rounds, medians; load avg {load_start:.2f} -> {load_end:.2f}; "
          f"{(time.time() - t_start) / 60:.1f} min; the box read {read_gbps:.1f} GB/s ({threads} threads, median of "
          f"the rounds' best of 5 sums of 1 GiB)")
    for title, group, width in (("float32 weights, float32 compute", lambda s: s not in HALF and "-" not in s, 4),
                                ("half-precision weights (bf16 / fp16)", lambda s: s in HALF, 2),
                                ("weight-only quantised", lambda s: s not in HALF and "-" in s, None)):
        rows = [s for s in med if group(s)]
        if not rows:
            continue
        gb = f"weights read at batch 1 ({read_bytes(shape, width) / 1e6:.0f} MB a token)" if width else ""
        print(f"\n{title}\n\n| system | threads | decode b=1 tok/s | decode b=16 tok/s | prefill 512 tok/s |"
              + (f" {gb}: GB/s, % of the box's read |" if width else ""))
        print("|---|---|---|---|---|" + ("---|" if width else ""))
        for s in rows:
            m = med[s]
            bw = m["decode_b1"] * read_bytes(shape, width) / 1e9 if width else None
            print(f"| {LABELS[s]} | {th[s]} | " + " | ".join(f"{m[k]:.1f}" for k in METRICS) + " |"
                  + (f" {bw:.1f} ({100 * bw / read_gbps:.0f}%) |" if width else ""))
    for s, why in skipped.items():
        print(f"SKIPPED {LABELS[s]}: {why}")
    report = {"shape": {"name": shape, **p}, "threads": threads, "read_gbps": reads,
              "threads_per_system": {LABELS[s]: t for s, t in th.items()},
              "decode_tokens": decode_tokens, "prompt_tokens": PROMPT, "prefill_tokens": LONG_PROMPT,
              "rounds": rounds, "engine_options": a["engine_options"],
              "loadavg_1m": {"start": load_start, "end": load_end}, "versions": _versions(a),
              "cpu": {"cores": os.cpu_count(), "machine": platform.machine(), "processor": _cpu_name()},
              "median": {LABELS[s]: m for s, m in med.items()},
              "best": {LABELS[s]: {m: max(x[m] for x in raw[s]) for m in METRICS} for s in med},
              "raw": {LABELS[s]: raw[s] for s in raw}, "half_precision": [LABELS[s] for s in HALF if s in raw],
              "skipped": {LABELS[s]: why for s, why in skipped.items()}}
    path = Path(json_path or REPO / "out" / f"cpu_peers_{shape}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"\nraw numbers: {path}")


def read_bytes(shape: str, width: int) -> int:
    """Bytes of weights a batch-1 decode step of `shape` reads at `width` bytes a weight: every linear layer's and the
    output's (the embedding gives one row)."""
    p = SHAPES[shape]
    d, f, hd = p["hidden_dim"], p["intermediate_dim"], p["hidden_dim"] // p["num_heads"]
    layer = d * hd * (2 * p["num_heads"] + 2 * p["num_kv_heads"]) + 3 * d * f
    return width * (p["num_layers"] * layer + p["vocab_size"] * d)


def _point_rate(gen, metric: str, tokens: int) -> float:
    """Tokens/s of one point for `gen(prompts, n)` (n new tokens per prompt): decode_bB, B * n / (time for n + 1 -
    time for 1) after an 8-token prompt, n = tokens at batch 1 and tokens / 2 above; prefill_512, two 512-token
    prompts making one token each."""
    def timed(p, n) -> float:
        t0 = time.perf_counter()
        gen(p, n)
        return time.perf_counter() - t0

    if metric == "prefill_512":
        p = _prompts(1, LONG_PROMPT)
        return 2 * LONG_PROMPT / (timed(p, 1) + timed(p, 1))
    b = int(metric.removeprefix("decode_b"))
    p, n = _prompts(b, PROMPT), tokens if b == 1 else tokens // 2
    t1 = timed(p, 1)
    return b * n / (timed(p, n + 1) - t1)


def paired(shape: str = "base", pmx: str = "pmx1", peer: str = "llama.cpp", pairs: int = 12, tokens: int = 64,
           point: str = "decode_b1", threads: int = 2, engine_options="{}", workdir: str = str(CACHE / "peers"),
           llama_cpp: str | None = None, install: bool = True) -> None:
    """pmx-runner TP=1 against one peer in alternating slices, a few seconds each: on a box whose bandwidth swings
    from minute to minute, the median of per-pair ratios resolves what round medians cannot. `pmx`: pmx1, pmx1-int8
    or pmx1-int4; `peer`: llama.cpp, llama.cpp-q8_0, llama.cpp-q4_0, ct2 or ct2-int8; `point`: decode_b1 (`tokens`
    tokens after an 8-token prompt: generate(n + 1) - generate(1) in this process, CTranslate2 likewise;
    llama.cpp: llama-bench -n tokens -d 8 -r 1) or prefill_512 (two 512-token prompts; llama-bench -p 512 -n 0).
    `peer` read (decode_b1 of pmx1 / pmx1-bf16 only): the box itself, its read rate held for a second (sums of 1 GiB
    one after another, `threads` threads: _sustained_read; the rounds' figure is the best of 5 single sums, a peak) as
    the tokens/s that moving a step's weight bytes (read_bytes) at it allows, so the ratio is the share of the box's
    read that batch-1 decode reaches, each pair in the same minute.

        python benchmarks/cpu_peers.py paired [--shape base|gqa] [--pmx pmx1-int4] [--peer llama.cpp-q4_0]
            [--point decode_b1|prefill_512] [--pairs 12] [--tokens 64]
    """
    import torch
    from runner.pmx.random_model import make_random_model
    quant = pmx.split("-", 1)[1] if "-" in pmx else None
    peers = ("llama.cpp", "llama.cpp-q8_0", "llama.cpp-q4_0", "llama.cpp-bf16", "ct2", "ct2-int8", *sorted(VENV_PEERS))
    pmxs = ("pmx1", "pmx1-int8", "pmx1-int4", "pmx1-bf16")
    if shape not in SHAPES or pmx not in pmxs or peer not in (*peers, "read") or point not in METRICS:
        raise SystemExit(f"paired: --shape base|gqa, --pmx {'|'.join(pmxs)}, --peer {'|'.join(peers)}|read, "
                         f"--point {'|'.join(METRICS)}")
    if peer == "read" and (point != "decode_b1" or pmx not in ("pmx1", "pmx1-bf16")):
        raise SystemExit("paired: --peer read measures --point decode_b1 of --pmx pmx1 or pmx1-bf16")
    work = Path(workdir).expanduser() / shape
    if not (work / "hf" / "config.json").exists():
        make_random_model(str(work / "hf"), **SHAPES[shape], overwrite=True)
    a = dict(work=work, hf=work / "hf", threads=threads, install=install,
             llama_cpp=llama_cpp or os.environ.get("PMX_LLAMA_CPP"))
    if peer.startswith("ct2") or peer in VENV_PEERS:  # both in jobs of their own (in one process, two OpenMP runtimes
        try:                                           # collide), a venv peer's run by its environment's Python
            if peer.startswith("ct2"):
                py, model, env = sys.executable, _ct2_model(a, "int8" if peer == "ct2-int8" else "float32"), {}
            else:
                import peer_venvs
                run = _prepare_venv_peer(peer, a)  # (installs and converts; its worker command is rebuilt here)
                py, model = run.python, run.model
                env = peer_venvs.peer_env(peer, threads)
        except Skip as e:
            raise SystemExit(f"paired: {LABELS[peer]} is not available: {e}") from None
        head = ["job_worker", "--tokens", tokens, "--threads", threads]
        others: dict = {}
        rates, ratios = _alternate({"peer": ([py, SELF, *head, peer, model], threads, env, REPO),
                                    "pmx": ([sys.executable, SELF, *head, "pmx", _pmx_model(1, a, quant),
                                             "--engine_options", json.dumps(_engine_options(engine_options))],
                                            threads)},
                                   [point], pairs, others=others)
        print(f"shape {shape}, {pairs} pairs, {LABELS[pmx]} / {LABELS[peer]}, {threads} threads each; the box read "
              f"{_read_bandwidth(threads):.1f} GB/s after:")
        _summary(rates, ratios, "peer", "pmx")
        # a job that keeps cores busy while the other one runs (vLLM's engine loop) takes them from its slices
        print("  cores kept busy by everything else during the slices, median: " + ", ".join(
            f"{LABELS[pmx] if n == 'pmx' else LABELS[peer]}'s {statistics.median(others[n, point]):.2f}"
            for n in ("pmx", "peer")))
        return
    if peer == "read":  # the box's read rate, in tokens/s at the weight bytes a step moves
        width = 2 if pmx == "pmx1-bf16" else 4
        peer_rate = lambda: _sustained_read(threads) * 1e9 / read_bytes(shape, width)  # noqa: E731
    else:
        try:
            bindir, gguf = _llama_cpp_model(a, peer.split("-", 1)[1] if "-" in peer else None)
            args = ("-p", "0", "-n", str(tokens), "-d", str(PROMPT)) if point == "decode_b1" else \
                ("-p", str(LONG_PROMPT), "-n", "0")
            if point == "decode_b16":
                peer_rate = lambda: _batched_bench(bindir, gguf, str(threads), str(tokens // 2))  # noqa: E731
            else:
                peer_rate = lambda: _llama_bench(bindir, gguf, str(threads), *args)["avg_ts"]  # noqa: E731
        except Skip as e:
            raise SystemExit(f"paired: {LABELS[peer]} is not available: {e}") from None
    torch.set_num_threads(threads)
    eng = open_engine(str(_pmx_model(1, a, quant)), engine_options)
    rate = partial(_point_rate, eng.generate, point, tokens)
    rate()  # warm-up

    ours, theirs = [], []
    for i in range(pairs):  # alternate who goes first
        x, y = (rate(), peer_rate()) if i % 2 == 0 else reversed((peer_rate(), rate()))
        ours.append(x)
        theirs.append(y)
        print(f"pair {i + 1}/{pairs}: {LABELS[pmx]} {x:.1f}, {LABELS[peer]} {y:.1f} tok/s, ratio {x / y:.3f}",
              file=sys.stderr, flush=True)
    eng.close()
    ratios = [x / y for x, y in zip(ours, theirs)]
    what = f"batch 1, {tokens} tokens a slice" if point == "decode_b1" else \
        "prefill of 512 tokens, 2 a slice" if point == "prefill_512" else f"decode {point.removeprefix('decode_')}"
    print(f"shape {shape}, {what}, {pairs} pairs: {LABELS[pmx]} {statistics.median(ours):.1f} tok/s, {LABELS[peer]} "
          f"{statistics.median(theirs):.1f} tok/s (medians); ratio median {statistics.median(ratios):.3f}, geometric "
          f"mean {statistics.geometric_mean(ratios):.3f}")


def job_worker(system: str, model: str, ctl: str, tokens: int = 64, threads: int = 2, engine_options="{}") -> None:
    """One measured job of `tp_paired` / `paired` / `versions` (every rank of it: system pmx, or ct2): loads the model,
    then measures what the command files ctl/cmd.K (K = 0, 1, ...) ask for, writing the rate (JSON: a number, or for
    the pmx point `mixed` a dict, see _mixed_point) to ctl/res.K (rank 0), until one says quit. It waits for a command
    by polling every 2 ms, so it takes no cycles from the job being measured. A pmx job's every rank writes
    ctl/info.RANK.json first: the `runner` it imported, the engine API found, its threads."""
    ctl, main_rank, steps = Path(ctl), True, {}
    if system == "pmx":
        import torch
        eng = open_engine(model, engine_options)
        gen, main_rank, close = eng.generate, eng.is_main, eng.close
        rank = next((os.environ[v] for v in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
                     if v in os.environ), "0")
        (ctl / f"info.{rank}.json").write_text(json.dumps({"rank": int(rank), "runner": eng.runner, "api": eng.api,
                                                           "threads": torch.get_num_threads(), "pid": os.getpid()}))
    elif system in VENV_PEERS:
        import peer_venvs
        gen, _ = peer_venvs.generator(system, model, threads)
        close = lambda: None  # noqa: E731
    else:
        import ctranslate2
        ct2 = ctranslate2.Generator(model, device="cpu", intra_threads=threads, inter_threads=1)
        vocab = json.loads((Path(model) / "vocabulary.json").read_text())
        gen = lambda p, n: ct2.generate_batch([[vocab[i] for i in x] for x in p], max_length=n,  # noqa: E731
                                              min_length=n, include_prompt_in_result=False)
        close = lambda: None  # noqa: E731
    for m in METRICS:  # warm-up
        _point_rate(gen, m, tokens)
    if main_rank:
        (ctl / "ready").write_text("")
    for k in range(1 << 30):
        cmd = ctl / f"cmd.{k}"
        while not cmd.exists():
            time.sleep(0.002)
        what = cmd.read_text()
        if what == "quit":
            break
        r = _mixed_point(eng, steps) if what == "mixed" else _point_rate(gen, what, tokens)
        if main_rank:
            (ctl / f"res.{k}.tmp").write_text(json.dumps(r))
            (ctl / f"res.{k}.tmp").rename(ctl / f"res.{k}")
    close()


BUSY_CORES = 0.25  # a slice during which other processes kept more cores than this busy is disturbed (versions)
STEP_ROWS = 128  # cache rows between the mixed point's sequences (cpu_step.py: 1024, for base 4.9 GB a job)


def _mixed_point(eng, steps: dict, reps: int = 3) -> dict:
    """The mixed step of benchmarks/cpu_step.py (64 sequences decoding one token after 64 of history, and one
    512-token prompt chunk, in one step through the ppl.pmx step contract) and the same two apart, taking turns step by
    step, each the median of `reps`; `steps` keeps the inputs and the cache from one call to the next (the first call
    builds them and runs each step once untimed). rate: the mixed step's tokens/s (576 tokens)."""
    import torch
    import cpu_step as cs
    first = not steps
    if first:
        g = torch.Generator().manual_seed(0)
        steps["cache"] = eng.new_cache(cs.cache_rows(STEP_ROWS))
        steps["inputs"] = {"mixed": cs.mixed_inputs(eng.vocab_size, g, STEP_ROWS),
                           "decode_b64": cs.decode_inputs(eng.vocab_size, cs.DECODERS, g, STEP_ROWS),
                           "prefill_512": cs.prefill_inputs(eng.vocab_size, g, STEP_ROWS)}
    ms = {k: t * 1e3 for k, t in cs.time_steps(eng.forward, steps["inputs"], steps["cache"], reps,
                                                 warmup=1 if first else 0).items()}
    return {"rate": (cs.DECODERS + cs.CHUNK) / ms["mixed"] * 1e3, "mixed_ms": ms["mixed"],
            "decode_b64_ms": ms["decode_b64"], "prefill_512_ms": ms["prefill_512"],
            "mixed_over_apart": ms["mixed"] / (ms["decode_b64"] + ms["prefill_512"])}


def _rate(r) -> float:
    """A job's figure for one point: its rate (tokens/s) whether the point gave a number or a dict."""
    return r["rate"] if isinstance(r, dict) else r


def _cpu_seconds(root: int | None = None) -> float:
    """CPU seconds used so far by process `root` and its descendants (their threads included), or (None) by the whole
    machine (/proc/stat: all but idle and iowait; steal, time the hypervisor gave to other guests, included)."""
    hz = os.sysconf("SC_CLK_TCK")
    if root is None:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return (sum(v) - v[3] - v[4]) / hz
    ticks, children = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the name: state, ppid, ..., utime (11), stime (12)
        except OSError:
            continue
        ticks[int(pid)] = int(fields[11]) + int(fields[12])
        children.setdefault(int(fields[1]), []).append(int(pid))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo += children.get(pid, [])
    return total / hz


def _alternate(jobs: dict, metrics: list, pairs: int, on_ready=None, others: dict | None = None
               ) -> tuple[dict, dict]:
    """Starts `jobs` ({label: (command, threads)} or {label: (command, threads, env, cwd)}, each running job_worker;
    env: variables set over this process's), lets them load one after the other, then has them measure each metric
    in turn, `pairs` times, alternating who goes first. `on_ready({label: [ctl/info.*.json of its ranks]})` is called
    once all are loaded (it may raise to stop). Returns (rates {(label, metric): [...]}, ratios {metric: [second /
    first, ...]}) for the two labels in order; a rate is what job_worker wrote (a number, or a dict holding "rate").
    With `others` (a dict), others[label, metric] lists, slice by slice, the cores that everything but the measured
    job kept busy meanwhile (CPU seconds a second; the idle job's and this process's polling included, ~0.02)."""
    import tempfile
    first, second = list(jobs)
    rates = {(n, m): [] for n in jobs for m in metrics}
    ratios = {m: [] for m in metrics}
    with tempfile.TemporaryDirectory(prefix="pmx-paired-") as tmp:
        procs, count = {}, {n: 0 for n in jobs}
        try:
            for i, (n, (cmd, threads, *rest)) in enumerate(jobs.items()):
                env, cwd = rest if rest else ({}, REPO)
                ctl = Path(tmp) / f"job{i}"
                ctl.mkdir()
                proc = subprocess.Popen([str(c) for c in cmd + ["--ctl", ctl]], cwd=cwd, start_new_session=True,
                                        env={**os.environ, "OMP_NUM_THREADS": str(threads), **env})
                procs[n] = (ctl, proc)
                while not (ctl / "ready").exists():  # loaded one after the other: their warm-ups do not overlap
                    if proc.poll() is not None:
                        raise SystemExit(f"{n}: the job exited ({proc.returncode}) before it was ready")
                    time.sleep(0.05)
            if on_ready:
                on_ready({n: [json.loads(f.read_text()) for f in sorted(ctl.glob("info.*.json"))]
                          for n, (ctl, _) in procs.items()})

            def measure(n: str, metric: str):
                ctl, proc = procs[n]
                k = count[n]
                count[n] += 1
                if others is not None:
                    t0, busy0, own0 = time.perf_counter(), _cpu_seconds(), _cpu_seconds(proc.pid)
                (ctl / f"cmd.{k}.tmp").write_text(metric)
                (ctl / f"cmd.{k}.tmp").rename(ctl / f"cmd.{k}")
                while not (ctl / f"res.{k}").exists():
                    if proc.poll() is not None:
                        raise SystemExit(f"{n}: the job exited ({proc.returncode}) measuring {metric}")
                    time.sleep(0.002)
                if others is not None:
                    busy, own = _cpu_seconds() - busy0, _cpu_seconds(proc.pid) - own0
                    others.setdefault((n, metric), []).append(max(0.0, busy - own) / (time.perf_counter() - t0))
                return json.loads((ctl / f"res.{k}").read_text())

            for i in range(pairs):
                for m in metrics:
                    got = {n: measure(n, m) for n in ((first, second) if i % 2 == 0 else (second, first))}
                    for n in jobs:
                        rates[n, m].append(got[n])
                    ratios[m].append(_rate(got[second]) / _rate(got[first]))
                print(f"pair {i + 1}/{pairs}: " + ", ".join(
                    f"{m} {first} {_rate(rates[first, m][-1]):.1f} {second} {_rate(rates[second, m][-1]):.1f} "
                    f"({ratios[m][-1]:.3f})" for m in metrics), file=sys.stderr, flush=True)
        finally:
            for n, (ctl, proc) in procs.items():
                (ctl / f"cmd.{count[n]}.tmp").write_text("quit")
                (ctl / f"cmd.{count[n]}.tmp").rename(ctl / f"cmd.{count[n]}")
            for n, (ctl, proc) in procs.items():
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, 9)
                    proc.wait()
    return rates, ratios


def _summary(rates: dict, ratios: dict, first: str, second: str) -> None:
    for m, r in ratios.items():
        print(f"  {m}: {first} {statistics.median(rates[first, m]):.1f}, {second} {statistics.median(rates[second, m]):.1f}"
              f" tok/s (medians); ratio median {statistics.median(r):.3f}, geometric mean "
              f"{statistics.geometric_mean(r):.3f}, range {min(r):.2f}-{max(r):.2f}")


def tp_paired(shape: str = "gqa", pairs: int = 12, tokens: int = 64, threads: int = 2, quant: str | None = None,
              metrics: str = ",".join(METRICS), engine_options="{}", workdir: str = str(CACHE / "peers")) -> None:
    """pmx-runner TP=2 (2 ranks x threads/2) against TP=1 (threads) at every point, in alternating slices: both
    jobs stay loaded and take turns, so each pair sees the same minute of the box. Prints the median of the
    per-pair TP=2 / TP=1 ratios for decode at batch 1 and 16 and a 512-token prefill (`--metrics`: some of them).

        python benchmarks/cpu_peers.py tp_paired [--shape gqa|base] [--pairs 12] [--quant int8|int4]
            [--metrics decode_b1,decode_b16,prefill_512]
    """
    from runner.pmx.random_model import make_random_model
    chosen = metrics.split(",") if isinstance(metrics, str) else list(metrics)
    if shape not in SHAPES or quant not in (None, "int8", "int4", "bf16") or not chosen or set(chosen) - set(METRICS):
        raise SystemExit(f"tp_paired: --shape base|gqa, --quant int8|int4|bf16 (or none), --metrics some of "
                         f"{','.join(METRICS)}")
    work = Path(workdir).expanduser() / shape
    if not (work / "hf" / "config.json").exists():
        make_random_model(str(work / "hf"), **SHAPES[shape], overwrite=True)
    a = dict(work=work, hf=work / "hf")
    jobs = {}
    for n in (1, 2):
        head = [REPO / "scripts" / "mpirun.sh", "-np", n] if n > 1 else []
        jobs[f"TP{n}"] = (head + [sys.executable, SELF, "job_worker", "pmx", _pmx_model(n, a, quant), "--tokens", tokens,
                                  "--engine_options", json.dumps(_engine_options(engine_options))],
                          max(1, threads // n))
    rates, ratios = _alternate(jobs, chosen, pairs)
    print(f"shape {shape}{' ' + quant if quant else ''}, {pairs} pairs, TP=2 ({max(1, threads // 2)} thread(s) a rank)"
          f" / TP=1 ({threads} threads):")
    _summary(rates, ratios, "TP1", "TP2")


def quant_ends(shape: str = "gqa", quant: str = "int8", pairs: int = 12, tokens: int = 64, threads: int = 2,
               metrics: str = "decode_b1", engine_options="{}", workdir: str = str(CACHE / "peers")) -> None:
    """pmx-runner TP=1 on two quantisations of the same weights, in alternating slices: the default (the output
    and the embedding quantised too) against `--quantize_output False --quantize_embedding False` (both float, the
    default before issue 29). Prints the per-pair default / float-ends ratios and both models' file bytes.

        python benchmarks/cpu_peers.py quant_ends [--shape gqa|base] [--quant int8|int4] [--pairs 12]
            [--metrics decode_b1,decode_b16,prefill_512]
    """
    from runner.pmx.convert import convert
    from runner.pmx.quant import scheme_from_flags
    from runner.pmx.random_model import make_random_model
    chosen = metrics.split(",") if isinstance(metrics, str) else list(metrics)
    if shape not in SHAPES or quant not in ("int8", "int4") or not chosen or set(chosen) - set(METRICS):
        raise SystemExit(f"quant_ends: --shape base|gqa, --quant int8|int4, --metrics some of {','.join(METRICS)}")
    work = Path(workdir).expanduser() / shape
    if not (work / "hf" / "config.json").exists():
        make_random_model(str(work / "hf"), **SHAPES[shape], overwrite=True)
    models = {"default": _pmx_model(1, dict(work=work, hf=work / "hf"), quant)}
    float_ends = work / f"pmx1-{quant}-float-ends"
    scheme = scheme_from_flags(quant, quantize_output=False, quantize_embedding=False)
    params = float_ends / "pmx_params.json"
    if not params.exists() or json.loads(params.read_text()).get("quantization") != scheme.to_dict():
        convert(str(work / "hf"), str(float_ends), overwrite=True, progress=False, quant=scheme)
    models["float_ends"] = float_ends
    sizes = {n: sum(f.stat().st_size for f in m.glob("model.*.safetensors")) for n, m in models.items()}
    head = [sys.executable, SELF, "job_worker", "pmx"]
    jobs = {n: (head + [m, "--tokens", tokens, "--engine_options", json.dumps(_engine_options(engine_options))],
                threads) for n, m in models.items()}
    load0 = os.getloadavg()[0]
    rates, ratios = _alternate({"float_ends": jobs["float_ends"], "default": jobs["default"]}, chosen, pairs)
    print(f"shape {shape} {quant}, {pairs} pairs, {threads} threads, load {load0:.1f} -> {os.getloadavg()[0]:.1f}; "
          f"files: default {sizes['default'] / 1e6:.1f} MB, output + embedding float "
          f"{sizes['float_ends'] / 1e6:.1f} MB")
    _summary(rates, ratios, "float_ends", "default")


VERSION_POINTS = METRICS + ("decode_b4", "mixed")  # decode_b4: a few rows (the quantised kernels' row path)


def _csv(x) -> list[str]:
    """A comma-separated flag as strings, whether fire left it a string or made it a tuple or a number."""
    if isinstance(x, (list, tuple)):
        return [str(v) for v in x]
    return [v.strip() for v in str(x).split(",") if v.strip()]


def _git(tree: Path) -> dict:
    def g(*args) -> str | None:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True).stdout.strip() or None
    return {"path": str(tree), "describe": g("describe", "--always", "--dirty"), "commit": g("rev-parse", "HEAD")}


def _tree_env(tree: Path, label: str) -> dict:
    """A job's environment for the code in `tree`: its runner first on the path (PYTHONPATH goes ahead of the venv's
    editable install), its own C++ extension builds (the two trees' sources would rebuild over each other in one
    directory), and no .pyc written into the tree."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])),
            "TORCH_EXTENSIONS_DIR": str(CACHE / f"ext-{label}"), "PYTHONDONTWRITEBYTECODE": "1"}


def _stats(r: list) -> dict:
    return {"median": statistics.median(r), "geomean": statistics.geometric_mean(r), "min": min(r), "max": max(r)}


def _own_model(tree: Path, label: str, n: int, a: dict, quant: str) -> Path:
    """The HF checkpoint converted by `tree`'s own `runner convert --quantize QUANT` at its defaults (a PMX format
    or default that changed between the trees: each job reads the files its version writes)."""
    pmx = a["work"] / f"pmx{n}-{quant}-{label}"
    subprocess.run([sys.executable, "-m", "runner", "convert", "--input_dir", a["hf"], "--output_dir", pmx,
                    "--num_shards", str(n), "--quantize", quant, "--overwrite", "True", "--progress", "false"],
                   check=True, cwd=tree, env={**os.environ, **_tree_env(tree, label)}, stdout=subprocess.DEVNULL)
    return pmx


def versions(base: str, shape: str = "gqa", tp="1,2", quant="none,int8", pairs: int = 12, tokens: int = 64,
             threads: int = 2, metrics: str = ",".join(VERSION_POINTS), engine_options="{}",
             json_path: str | None = None, workdir: str = str(CACHE / "peers"), own_models: bool = False,
             model: str | None = None) -> None:
    """The code at `base` ("before") against this checkout ("after"), paired as tp_paired: for each shape, TP and
    weights, one job of each (the same model files and threads; TP=2: scripts/mpirun.sh -np 2, threads / 2 a rank)
    stays loaded and they take turns at every point, alternating who goes first. Prints, per point, the median of
    the per-pair after / before ratios of tokens/s (above 1: after is faster), their geometric mean and range; for
    `mixed` (cpu_step.py's mixed step: 64 decoding + one 512-token chunk, and the two apart) the after / before
    ratio of the mixed step's time (below 1: after is faster) and each tree's mixed / apart; then one table of all.
    Each slice also records the cores other processes kept busy meanwhile: a pair where either slice saw more than
    BUSY_CORES is not quiet, and the quiet pairs' medians are printed beside the medians of all. Every raw figure
    goes to `json_path` (default out/versions_SHAPE.json), written after each configuration.

        python benchmarks/cpu_peers.py versions --base /work/baseline [--shape gqa|base|all] [--tp 1,2]
            [--quant none,int8] [--pairs 12] [--metrics decode_b1,decode_b16,prefill_512,mixed] [--own_models True]

    With `own_models`, each tree runs the quantised model its own `runner convert --quantize Q` writes at its
    defaults (for a change of the quantised format or its defaults; the files' sizes are printed); float models are
    shared as always. With `model` (a PMX directory, e.g. a GGUF's conversion), both trees run that model instead of
    the shapes' (at TP = its shard count; --shape, --tp and --quant are not used).
    """
    before, after = Path(base).expanduser().resolve(), REPO
    shapes = list(SHAPES) if shape == "all" else _csv(shape)
    tps, quants, chosen = _csv(tp), _csv(quant), _csv(metrics)
    if model is not None:  # one model of the caller's, at its shard count
        own = json.loads((Path(model) / "pmx_params.json").read_text())
        shapes, tps, quants = ["gqa"], [str(own.get("num_shards", 1))], ["none"]
    if set(shapes) - set(SHAPES) or not shapes or set(tps) - {"1", "2"} or not tps or \
            set(quants) - {"none", "int8", "int4", "bf16"} or not quants or set(chosen) - set(VERSION_POINTS) or not chosen:
        raise SystemExit(f"versions: --shape base|gqa|all, --tp some of 1,2, --quant some of none,int8,int4,bf16, "
                         f"--metrics some of {','.join(VERSION_POINTS)}")
    if not (before / "runner" / "__init__.py").is_file():
        raise SystemExit(f"versions: --base {before} holds no runner/ (a checkout of pmx-runner, e.g. a git worktree)")
    sys.path.insert(0, str(REPO))  # the conversions by this checkout's runner (not the venv's editable install's)
    import torch
    from runner.pmx.random_model import make_random_model
    opts, trees = _engine_options(engine_options), {"before": before, "after": after}
    report = {"command": sys.argv[1:], "trees": {k: _git(t) for k, t in trees.items()},
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "mpi4py": _versions({})["mpi4py"]},
              "cpu": {"cores": os.cpu_count(), "machine": platform.machine(), "processor": _cpu_name()},
              "threads": threads, "tokens": tokens, "pairs": pairs, "engine_options": opts, "step_rows": STEP_ROWS,
              "ratios": "after / before of tokens/s (mixed: also of the mixed step's time)", "configs": []}
    path = Path(json_path or REPO / "out" / f"versions_{shape}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"before: {before} ({report['trees']['before']['describe']}); after: {after} "
          f"({report['trees']['after']['describe']}); {_cpu_name()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}; "
          f"{pairs} pairs, {threads} threads; ratios after / before", flush=True)
    t_all = time.time()
    for sh in shapes:
        work = Path(workdir).expanduser() / sh
        if model is None and not (work / "hf" / "config.json").exists():
            make_random_model(str(work / "hf"), **SHAPES[sh], overwrite=True)
        a = dict(work=work, hf=work / "hf")
        for n in map(int, tps):
            for q in quants:
                per_rank = max(1, threads // n)
                if own_models and q != "none":
                    models = {k: _own_model(t, k, n, a, q) for k, t in trees.items()}
                    print(f"\n{sh} TP={n} {q}: each tree's own files, " + ", ".join(
                        f"{k} {sum(f.stat().st_size for f in m.glob('model.*.safetensors')) / 1e6:.1f} MB"
                        for k, m in models.items()), flush=True)
                else:
                    models = dict.fromkeys(trees, Path(model).resolve() if model is not None else
                                           _pmx_model(n, a, None if q == "none" else q))
                head = [REPO / "scripts" / "mpirun.sh", "-np", n] if n > 1 else []
                cmds = {k: head + [sys.executable, SELF, "job_worker", "pmx", m, "--tokens", tokens,
                                   "--engine_options", json.dumps(opts)] for k, m in models.items()}
                name = f"{sh} TP={n} {'fp32' if q == 'none' else q}" if model is None else f"{model} TP={n}"
                rec = {"shape": {"name": sh, **SHAPES[sh]} if model is None else {"name": str(model)}, "tp": n,
                       "quant": q if model is None else (own.get("quantization") or {}).get("method", "float"),
                       **({} if model is None else {"quantization": own.get("quantization")}),
                       "model": {k: str(m) for k, m in models.items()}, "threads_per_rank": per_rank, "jobs": {},
                       "loadavg": {"start": os.getloadavg()}}

                def check(infos: dict) -> None:  # every rank of each job runs its own tree's runner
                    for label, ranks in infos.items():
                        wrong = [i["runner"] for i in ranks if not Path(i["runner"]).is_relative_to(trees[label])]
                        if len(ranks) != n or wrong:
                            raise SystemExit(f"versions: the {label} job imported runner from {wrong or ranks}, "
                                             f"not from {trees[label]} on {n} rank(s)")
                        print(f"  {label}: {ranks[0]['runner']} ({ranks[0]['api']}), {n} x {ranks[0]['threads']} "
                              f"thread(s)", flush=True)
                    rec["jobs"] = infos

                t0 = time.time()
                print(f"\n{name}: loading", flush=True)
                others = {}
                rates, ratios = _alternate({k: (cmds[k], per_rank, _tree_env(t, k), t) for k, t in trees.items()},
                                           chosen, pairs, on_ready=check, others=others)
                rec.update(seconds=time.time() - t0, first_in_pair=["before" if i % 2 == 0 else "after"
                                                                    for i in range(pairs)])
                rec["loadavg"]["end"] = os.getloadavg()
                rec["points"] = {m: {"before": rates["before", m], "after": rates["after", m],
                                     "after_over_before": ratios[m], **_stats(ratios[m]),
                                     "other_cores": {k: others[k, m] for k in trees}} for m in chosen}
                if "mixed" in chosen:
                    pt = rec["points"]["mixed"]
                    pt["time_after_over_before"] = [y["mixed_ms"] / x["mixed_ms"] for x, y in zip(pt["before"],
                                                                                                 pt["after"])]
                    pt["time"] = _stats(pt["time_after_over_before"])
                    pt["mixed_over_apart"] = {k: _stats([x["mixed_over_apart"] for x in pt[k]]) for k in trees}
                for m, pt in rec["points"].items():  # quiet: no other process kept BUSY_CORES busy in either slice
                    r = pt["time_after_over_before"] if m == "mixed" else pt["after_over_before"]
                    pt["quiet_pairs"] = [i for i in range(pairs) if max(pt["other_cores"]["before"][i],
                                                                        pt["other_cores"]["after"][i]) <= BUSY_CORES]
                    if pt["quiet_pairs"]:
                        pt["quiet"] = _stats([r[i] for i in pt["quiet_pairs"]])
                busy = statistics.median(x for pt in rec["points"].values() for k in trees
                                         for x in pt["other_cores"][k])
                print(f"{name}: {n} rank(s) x {per_rank} thread(s), {pairs} pairs, "
                      f"load {rec['loadavg']['start'][0]:.2f} -> {rec['loadavg']['end'][0]:.2f}, "
                      f"{rec['seconds'] / 60:.1f} min; other processes: {busy:.2f} cores a slice (median), quiet "
                      f"pairs " + ", ".join(f"{m} {len(pt['quiet_pairs'])}" for m, pt in rec["points"].items()))
                _summary({k: v for k, v in rates.items() if k[1] != "mixed"},
                         {m: r for m, r in ratios.items() if m != "mixed"}, "before", "after")
                if "mixed" in chosen:
                    pt = rec["points"]["mixed"]
                    ms = {k: statistics.median(x["mixed_ms"] for x in pt[k]) for k in trees}
                    moa = pt["mixed_over_apart"]
                    print(f"  mixed step (64 decoding + 512 prefill): before {ms['before']:.1f}, after "
                          f"{ms['after']:.1f} ms (medians); time ratio median {pt['time']['median']:.3f}, geometric "
                          f"mean {pt['time']['geomean']:.3f}, range {pt['time']['min']:.2f}-{pt['time']['max']:.2f}; "
                          f"mixed / apart: before {moa['before']['median']:.3f}, after {moa['after']['median']:.3f}")
                for m, pt in rec["points"].items():
                    if 0 < len(pt["quiet_pairs"]) < pairs:
                        q = pt["quiet"]
                        print(f"  {m}, the {len(pt['quiet_pairs'])} quiet pairs only: {'time ' * (m == 'mixed')}"
                              f"ratio median {q['median']:.3f}, range {q['min']:.2f}-{q['max']:.2f}")
                report["configs"].append(rec)
                path.write_text(json.dumps(report, indent=1))
    report["minutes"] = (time.time() - t_all) / 60
    path.write_text(json.dumps(report, indent=1))
    _versions_table(report)
    print(f"\n{report['minutes']:.1f} min; raw numbers: {path}")


def _versions_table(report: dict) -> None:
    """All configurations of a `versions` run in one markdown table, and what misses issue 24's marks."""
    cols = [("decode_b1", "decode b=1"), ("decode_b16", "decode b=16"), ("prefill_512", "prefill 512"),
            ("mixed", "mixed step time")]

    def cell(s: dict) -> str:
        return f"{s['median']:.3f} ({s['min']:.2f}-{s['max']:.2f})"

    print(f"\nafter / before, median of {report['pairs']} per-pair ratios (range): tokens/s, above 1 is faster; "
          f"the mixed step's time, below 1 is faster. Quiet pairs: no other process kept {BUSY_CORES} cores busy "
          f"in either slice (the fewest of any point)\n")
    print("| shape | TP | weights | " + " | ".join(c for _, c in cols) + " | mixed / apart, before / after | "
          "quiet pairs |")
    print("|---|---|---|---|---|---|---|---|---|")
    misses = []
    for c in report["configs"]:
        pts, w = c["points"], "fp32" if c["quant"] == "none" else c["quant"]
        name = f"{c['shape']['name']} TP={c['tp']} {w}"
        row = []
        for m, label in cols:
            if m not in pts:
                row.append("")
                continue
            s = pts[m]["time"] if m == "mixed" else pts[m]
            row.append(cell(s))
            if (s["median"] > 1.03) if m == "mixed" else (s["median"] < 0.97):
                q = pts[m].get("quiet")
                misses.append(f"{name} {label} {s['median']:.3f}" + (
                    f" ({len(pts[m]['quiet_pairs'])} quiet pairs: {q['median']:.3f})" if q else " (no quiet pair)"))
        if "mixed" in pts:
            moa = pts["mixed"]["mixed_over_apart"]
            row.append(f"{moa['before']['median']:.3f} / {moa['after']['median']:.3f}")
            if moa["after"]["median"] > 1.3:
                misses.append(f"{name} mixed / apart {moa['after']['median']:.3f}")
        else:
            row.append("")
        row.append(f"{min(len(p['quiet_pairs']) for p in pts.values())}/{report['pairs']}")
        print(f"| {c['shape']['name']} | {c['tp']} | {w} | " + " | ".join(row) + " |")
    print("\nissue 24's marks (medians: tokens/s ratio >= 0.97, mixed step time ratio <= 1.03, after's mixed / apart "
          "<= 1.3): " + ("all met" if not misses else "missed: " + "; ".join(misses)))


def _cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    commands = {"main": main, "worker": worker, "paired": paired, "job_worker": job_worker, "tp_paired": tp_paired,
                "versions": versions, "quant_ends": quant_ends}
    fire.Fire(commands if len(sys.argv) > 1 and sys.argv[1] in set(commands) - {"main"} else main)
