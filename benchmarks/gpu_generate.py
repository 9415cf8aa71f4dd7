#!/usr/bin/env python3
"""GPU decode speed against the HBM-bandwidth roofline, beside transformers (and vLLM where importable), in one run.

A Llama-2-7B-shaped model with random fp16 weights made in memory (dim 4096, 32 layers, 32 heads, intermediate
11008, vocab 32000; no checkpoint needed). A decode step reads every weight once (and the KV cache of each
sequence), so at batch 1 its floor is bytes / HBM bandwidth: the roofline. Measured here:

- pmx-runner (`python -m runner bench` with random weights: Triton kernels, CUDA graphs unless
  `--cuda_graphs false`): decode ms per step and tokens/s for each batch size (1 .. 256), the bandwidth that
  implies and its share of the roofline (`roofline_fraction`, at batch 1), and the batch-1 step without CUDA
  graphs for comparison;
- transformers (`generate`, eager, same shapes and dtype) decode tokens/s for `--hf_batches`;
- vLLM (dummy weights, same shapes) when it imports, for the same batches as transformers.

The HBM bandwidth comes from the GPU's name: H100 SXM 3.35 TB/s, H100 PCIe 2.0, H100 NVL 3.9, H200 4.8, A100 80GB
SXM 2.0, A100 80GB PCIe 1.94 (others: give `--hbm_tbs`, else no roofline, with a warning). Results go to
benchmarks/results/gpu-<gpu>-<date>.json (with a top-level `roofline_fraction`) and .md (the table), with the
GPU name, driver, CUDA, torch, triton, transformers and vLLM versions. The issue's target: batch-1 decode at
>= 85% of the roofline and >= 5x transformers (`target.met`).

    python benchmarks/gpu_generate.py [--layers 32] [--batches "1 2 4 8 16 32 64 128 256"] [--gen_len 128]
        [--hf_batches "1 8 32"] [--vllm true] [--hbm_tbs 3.35] [--cuda_graphs true] [--out_dir benchmarks/results]
"""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

import fire
import torch

RESULTS = Path(__file__).resolve().parent / "results"


# --- the roofline (no GPU needed) ---------------------------------------------------------------------------
# (pattern on the upper-cased device name, TB/s, the part it names); the first match wins
HBM_TBS = (
    (r"GH200", None, "GH200 (HBM3 or HBM3e: give --hbm_tbs)"),
    (r"H200", 4.8, "H200 (HBM3e)"),
    (r"H100.*NVL", 3.9, "H100 NVL"),
    (r"H100.*PCIE", 2.0, "H100 PCIe"),
    (r"H100", 3.35, "H100 SXM"),
    (r"A100.*80\s*GB.*PCIE|A100.*PCIE.*80\s*GB", 1.94, "A100 80GB PCIe"),
    (r"A100.*80\s*GB", 2.0, "A100 80GB SXM"),
)


def hbm_bandwidth(name: str) -> tuple[Optional[float], str]:
    """(peak HBM bandwidth in TB/s, the part) for a CUDA device name; (None, why) when it is not known."""
    upper = name.upper()
    for pattern, tbs, part in HBM_TBS:
        if re.search(pattern, upper):
            return tbs, part
    return None, f"{name}: HBM bandwidth not known here"


@dataclass(frozen=True)
class Shape:
    hidden: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 32
    intermediate: int = 11008
    vocab: int = 32000

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA2_7B = Shape()


def weight_bytes(s: Shape, dtype_bytes: int = 2) -> int:
    """Bytes of weights one decode step reads: every linear of every layer, the norms and the output head (the
    embedding table gives one row per token, which is negligible and not counted)."""
    kv_dim = s.kv_heads * s.head_dim
    per_layer = s.hidden * (s.hidden + 2 * kv_dim) + s.hidden * s.hidden + 3 * s.hidden * s.intermediate + 2 * s.hidden
    return dtype_bytes * (s.layers * per_layer + s.vocab * s.hidden + s.hidden)


def kv_bytes(s: Shape, context: float, dtype_bytes: int = 2) -> float:
    """Bytes of K and V one sequence's decode step reads at `context` cached tokens."""
    return 2 * s.layers * s.kv_heads * s.head_dim * dtype_bytes * context


def step_bytes(s: Shape, batch: int, context: float) -> float:
    return weight_bytes(s) + batch * kv_bytes(s, context)


def roofline_ms(s: Shape, batch: int, context: float, tbs: float) -> float:
    """The least time of one decode step at `tbs` TB/s: its bytes over the bandwidth."""
    return step_bytes(s, batch, context) / (tbs * 1e12) * 1e3


def engine_rows(rows: list[dict], s: Shape, context: float, tbs: Optional[float]) -> list[dict]:
    """bench()'s rows with tokens/s, GB/s and the share of the roofline of each decode step."""
    out = []
    for r in rows:
        b, ms = r["batch"], r["decode_ms"]
        row = dict(batch=b, decode_ms=ms, decode_tok_s=b * 1e3 / ms, gb_s=step_bytes(s, b, context) / (ms * 1e-3) / 1e9,
                   throughput_tok_s=r["tps"], prefill_ms=r["prefill_ms"], mem_gib=r["mem_gib"])
        row["roofline_fraction"] = roofline_ms(s, b, context, tbs) / ms if tbs else None
        out.append(row)
    return out


def summarise(result: dict) -> dict:
    """Adds the batch-1 figures and the issue's target to `result` (rows already in)."""
    b1 = next((r for r in result["pmx"] if r["batch"] == 1), None)
    hf1 = next((r for r in result.get("transformers", []) if r["batch"] == 1), None)
    result["batch1_tok_s"] = b1["decode_tok_s"] if b1 else None
    result["roofline_fraction"] = b1["roofline_fraction"] if b1 else None
    result["speedup_vs_transformers"] = (b1["decode_tok_s"] / hf1["decode_tok_s"]) if b1 and hf1 else None
    rf, sp = result["roofline_fraction"], result["speedup_vs_transformers"]
    result["target"] = dict(roofline_fraction=0.85, speedup_vs_transformers=5.0,
                            met=bool(rf is not None and sp is not None and rf >= 0.85 and sp >= 5.0))
    return result


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render_markdown(r: dict) -> str:
    v = r["versions"]
    s = Shape(**r["shape"])
    lines = [f"# GPU decode: {v['gpu']}, {r['date']}", "",
             f"{v['gpu']} ({r['hbm_part']}, {_f(r['hbm_tbs'], 'g')} TB/s HBM), driver {v['driver']}, CUDA {v['cuda']}, "
             f"torch {v['torch']}, triton {v['triton']}, transformers {v['transformers']}, vLLM {v['vllm']}.", "",
             f"Llama-2-7B shape ({s.layers} layers, dim {s.hidden}, {s.heads} heads, intermediate {s.intermediate}, "
             f"vocab {s.vocab}), fp16, random weights; {r['input_len']}-token prompts, {r['gen_len']} generated "
             f"tokens; a decode step reads {weight_bytes(s) / 1e9:.2f} GB of weights (+ the KV cache). "
             f"pmx-runner: kernels={r['kernels']}, CUDA graphs {r['cuda_graphs']}.", "",
             f"**Batch-1 decode: {_f(r['batch1_tok_s'], '.1f')} tokens/s, {_f(r['roofline_fraction'] and 100 * r['roofline_fraction'], '.1f')}% "
             f"of the roofline, {_f(r['speedup_vs_transformers'], '.2f')}x transformers** (target >= 85% and >= 5x: "
             f"{'met' if r['target']['met'] else 'not met'}).", "",
             "| batch | decode ms/step | decode tokens/s | GB/s | % of roofline | throughput tokens/s (with prefill) |",
             "|---|---|---|---|---|---|"]
    for row in r["pmx"]:
        pct = row["roofline_fraction"] and 100 * row["roofline_fraction"]
        lines.append(f"| {row['batch']} | {row['decode_ms']:.3f} | {row['decode_tok_s']:.1f} | {row['gb_s']:.0f} | "
                     f"{_f(pct, '.1f')} | {row['throughput_tok_s']:.1f} |")
    if r.get("pmx_eager_batch1"):
        e = r["pmx_eager_batch1"]
        lines += ["", f"Without CUDA graphs, batch 1: {e['decode_ms']:.3f} ms/step, {e['decode_tok_s']:.1f} tokens/s."]
    for name in ("transformers", "vllm"):
        rows = r.get(name)
        if isinstance(rows, list) and rows:
            lines += ["", f"| {name} batch | decode tokens/s |", "|---|---|"]
            lines += [f"| {x['batch']} | {x['decode_tok_s']:.1f} |" for x in rows]
        elif isinstance(rows, str):
            lines += ["", f"{name}: {rows}"]
    return "\n".join(lines) + "\n"


def write_results(result: dict, out_dir: Path) -> tuple[Path, Path]:
    """benchmarks/results/gpu-<gpu>-<date>.json and .md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"gpu-{re.sub(r'[^A-Za-z0-9]+', '-', result['versions']['gpu']).strip('-')}-{result['date']}"
    js, md = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    js.write_text(json.dumps(result, indent=1) + "\n")
    md.write_text(render_markdown(result))
    return js, md


# --- measurements (CUDA) --------------------------------------------------------------------------------------
def versions() -> dict:
    import triton
    import transformers
    try:
        import vllm
        vllm_version = vllm.__version__
    except Exception:  # noqa: BLE001 - not installed, or broken: reported as such
        vllm_version = "not installed"
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        driver = "unknown"
    return dict(gpu=torch.cuda.get_device_name(), driver=driver, cuda=torch.version.cuda, torch=torch.__version__,
                triton=triton.__version__, transformers=transformers.__version__, vllm=vllm_version)


def _params_file(s: Shape, work: Path) -> Path:
    from runner.pmx.params import PmxParams
    PmxParams(model_type="llama", hidden_dim=s.hidden, intermediate_dim=s.intermediate, num_layers=s.layers,
              num_heads=s.heads, num_kv_heads=s.kv_heads, head_dim=s.head_dim, vocab_size=s.vocab, norm_eps=1e-5,
              rope_theta=10000.0, max_position_embeddings=4096, dtype="float16").save(work)
    return work / "pmx_params.json"


def _hf_config(s: Shape):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
                       num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, vocab_size=s.vocab,
                       max_position_embeddings=4096, torch_dtype="float16")


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def transformers_decode(s: Shape, batches: list[int], input_len: int, gen_len: int) -> list[dict]:
    """transformers' generate (greedy, no early stop): decode tokens/s = tokens after the first / their time."""
    from transformers import LlamaForCausalLM
    with torch.device("cuda"):
        model = LlamaForCausalLM(_hf_config(s)).half().eval()
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    rows = []
    with torch.inference_mode():
        for b in batches:
            ids = torch.randint(3, s.vocab, (b, input_len), device="cuda")
            model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)       # warm-up
            times = []
            for n in (1, gen_len + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            rows.append(dict(batch=b, decode_tok_s=b * gen_len / (times[1] - times[0])))
    del model
    _free()
    return rows


def vllm_decode(s: Shape, batches: list[int], input_len: int, gen_len: int, work: Path):
    """vLLM with dummy weights of the same shapes; its rows, or why it did not run."""
    try:
        from vllm import LLM, SamplingParams
    except Exception as e:  # noqa: BLE001
        return f"not run ({type(e).__name__}: {e})"
    try:
        hf_dir = work / "hf"
        _hf_config(s).save_pretrained(hf_dir)
        llm = LLM(model=str(hf_dir), dtype="float16", load_format="dummy", skip_tokenizer_init=True,
                  gpu_memory_utilization=0.6, max_model_len=input_len + gen_len + 16)
        rows = []
        for b in batches:
            prompts = [{"prompt_token_ids": torch.randint(3, s.vocab, (input_len,)).tolist()} for _ in range(b)]
            times = []
            for n in (8, 1, gen_len + 1):                                      # warm-up, prefill, whole
                sp = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False)
                t0 = time.perf_counter()
                llm.generate(prompts, sp, use_tqdm=False)
                times.append(time.perf_counter() - t0)
            rows.append(dict(batch=b, decode_tok_s=b * gen_len / (times[2] - times[1])))
        del llm
        _free()
        return rows
    except Exception as e:  # noqa: BLE001 - vLLM's own failure is a result, not this benchmark's
        return f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


def main(layers: int = 32, batches: str = "1 2 4 8 16 32 64 128 256", input_len: int = 8, gen_len: int = 128,
         hf_batches: str = "1 8 32", vllm: bool = True, hbm_tbs: Optional[float] = None, kernels: str = "auto",
         cuda_graphs: bool = True, out_dir: str = str(RESULTS)) -> None:
    """Measures and writes the results (see the module's docstring).

    Args:
        layers: transformer layers of the Llama-2-7B shape (32; fewer for a quick look).
        batches: pmx-runner batch sizes.
        input_len: prompt tokens per sequence.
        gen_len: tokens generated per sequence.
        hf_batches: transformers' (and vLLM's) batch sizes ("" for none).
        vllm: also measure vLLM when it imports.
        hbm_tbs: the GPU's HBM bandwidth in TB/s (default: from its name).
        kernels: pmx-runner's kernels (auto: Triton on CUDA).
        cuda_graphs: pmx-runner replays decode steps from CUDA graphs.
        out_dir: where the JSON and the Markdown go.
    """
    from runner.args import int_list, parse_bool, parse_float
    from runner.config import EngineConfig
    from runner.engine.bench import bench
    vllm, cuda_graphs = parse_bool("vllm", vllm), parse_bool("cuda_graphs", cuda_graphs)  # fire keeps "false" a str
    hbm_tbs = None if hbm_tbs is None else parse_float("hbm_tbs", hbm_tbs)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_generate.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    s = Shape(layers=layers)
    batch_list = int_list(batches, "batches", minimum=1, allow_empty=False)
    hf_list = int_list(hf_batches, "hf_batches", minimum=1)
    v = versions()
    part_tbs, part = hbm_bandwidth(v["gpu"])
    tbs = hbm_tbs if hbm_tbs is not None else part_tbs
    if tbs is None:
        warnings.warn(f"{part}: no roofline (give --hbm_tbs)")
    context = input_len + gen_len / 2  # the mean cached tokens of a decode step
    work = Path(tempfile.mkdtemp(prefix="pmx-gpu-bench-"))
    params = str(_params_file(s, work))
    common = dict(random_weights=True, input_len=input_len, gen_len=gen_len, progress=True)
    config = EngineConfig(device="cuda", dtype="float16", kernels=kernels, cuda_graphs=cuda_graphs)
    rows = bench(params, batch_sizes=batch_list, config=config, **common)
    _free()
    eager = None
    if cuda_graphs and 1 in batch_list:
        eager = engine_rows(bench(params, batch_sizes=[1], config=replace(config, cuda_graphs=False), **common), s,
                            context, tbs)[0]
        _free()
    result = dict(date=time.strftime("%Y-%m-%d"), versions=v, hbm_tbs=tbs, hbm_part=part, shape=asdict(s),
                  input_len=input_len, gen_len=gen_len, kernels=kernels, cuda_graphs=cuda_graphs,
                  weight_bytes=weight_bytes(s), mean_context=context, pmx=engine_rows(rows, s, context, tbs),
                  pmx_eager_batch1=eager)
    if hf_list:
        result["transformers"] = transformers_decode(s, hf_list, input_len, gen_len)
        if vllm:
            result["vllm"] = vllm_decode(s, hf_list, input_len, gen_len, work)
    summarise(result)
    js, md = write_results(result, Path(out_dir))
    print(render_markdown(result))
    print(f"wrote {js} and {md}", file=sys.stderr)


if __name__ == "__main__":
    fire.Fire(main)
