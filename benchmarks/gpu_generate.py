#!/usr/bin/env python3
"""GPU decode and prefill against the HBM-bandwidth roofline and the matrix peak, beside transformers (and vLLM where
importable), in one run: what benchmarks/gpu_session.sh's `decode` stage measures.

A Llama-2-7B-shaped model with random weights made in memory (dim 4096, 32 layers, 32 heads, intermediate 11008, vocab
32000; no checkpoint needed). A decode step reads every weight once (and the KV cache of each sequence), so at batch 1
its floor is bytes / HBM bandwidth: the roofline. Measured here, each part in its own engine session (a part that
fails is recorded with its error and the others still run):

- float16 decode ms per step and tokens/s for each batch size (`--batches`), the bandwidth that implies and its share
  of the roofline (`roofline_fraction`; the top-level one is batch 1's), and batch 1 without CUDA graphs (`--eager`);
- the decode-step fusions at batch 1 (`--variants`, EngineConfig flags): `none` (every fusion off), `-norm`,
  `-rotary`, `-merge` (all but that one), `+pdl` (all and programmatic dependent launch), `cublas` (the linears on
  cuBLAS, --decode_linears false); each against the default (all fusions) in the same process;
- weight-only quantised batch-1 decode (`--quant`: int8 per channel, int4g128, and GGUF's int8g32 / int4g32o (offsets)
  where this checkout has those schemes) as tokens/s and the ratio to float16's;
- bfloat16 batch-1 decode (`--bf16`): a bfloat16 checkpoint computes in bfloat16;
- a `--prefill_len`-token prefill at batch 1 in one step: ms, TFLOP/s and its share of the dense float16 peak (the
  datasheet's by the GPU's name, and the matrix product measured here: `matmul_tflops`), beside the HBM copy bandwidth
  measured here (`copy_tbs`);
- transformers (`generate`, eager, same shapes) decode tokens/s for `--hf_batches`; vLLM (dummy weights) when it
  imports and `--vllm`.

The HBM bandwidth comes from the GPU's name: H100 SXM 3.35 TB/s, H100 PCIe 2.0, H100 NVL 3.9, H200 4.8, A100 80GB
SXM 2.0, A100 80GB PCIe 1.94 (others: give `--hbm_tbs`, else no roofline, with a warning). Results go to
`--out_dir`/gpu-<gpu>-<date>.json (or `--json_path`) and .md, with the GPU name, driver, CUDA, torch, triton,
transformers and vLLM versions. The issue's targets (`targets`): batch-1 decode >= 85% of the roofline, batch 64 >= 75%,
int8 >= 1.7x and int4 >= 2.6x float16's batch-1 tokens/s, the prefill >= 50% of the dense float16 peak.

`--device cpu --shape tiny` runs every part on a small model on the CPU (torch kernels: the fusion flags change
nothing there), which is how gpu_session.sh rehearses this script without a GPU.

    python benchmarks/gpu_generate.py [--layers 32] [--batches "1 16 64"] [--gen_len 64] [--hf_batches 1]
        [--variants none,-norm,-rotary,-merge,+pdl,cublas] [--quant "int8 int4g128 int8g32 int4g32o"] [--bf16 true]
        [--prefill_len 2048] [--eager false] [--vllm false] [--hbm_tbs 3.35] [--out_dir benchmarks/results]
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


# --- the roofline and the peak (no GPU needed) -----------------------------------------------------------------------
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
# dense float16 / bfloat16 matrix peak (TFLOP/s, no sparsity), by the vendor's datasheets
FP16_TFLOPS = ((r"H200", 989.4), (r"H100.*NVL", 835.5), (r"H100.*PCIE", 756.5), (r"H100", 989.4), (r"A100", 312.0))


def hbm_bandwidth(name: str) -> tuple[Optional[float], str]:
    """(peak HBM bandwidth in TB/s, the part) for a CUDA device name; (None, why) when it is not known."""
    upper = name.upper()
    for pattern, tbs, part in HBM_TBS:
        if re.search(pattern, upper):
            return tbs, part
    return None, f"{name}: HBM bandwidth not known here"


def fp16_peak(name: str) -> Optional[float]:
    """The dense float16 matrix peak in TFLOP/s of a CUDA device name (None where not known)."""
    return next((t for pattern, t in FP16_TFLOPS if re.search(pattern, name.upper())), None)


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
SHAPES = {"7b": LLAMA2_7B, "tiny": Shape(hidden=256, layers=2, heads=4, kv_heads=4, intermediate=512, vocab=512)}


@dataclass(frozen=True)
class Quant:
    """A weight-only scheme of --quant: int8 (per channel), int8g32 (groups of 32), int4g128, int4g32o (offsets)."""
    spec: str
    method: str
    group_size: int
    offset: bool

    @classmethod
    def parse(cls, spec: str) -> "Quant":
        m = re.fullmatch(r"(int8|int4)(?:g(\d+))?(o?)", spec)
        if not m or (m.group(1) == "int4" and not m.group(2)):
            raise SystemExit(f"--quant: {spec!r} is not a scheme (int8, int8g32, int4g128, int4g32o: method, g and "
                             f"the group size, o for offsets)")
        return cls(spec, m.group(1), int(m.group(2) or 0), bool(m.group(3)))

    def as_dict(self) -> dict:
        """The pmx_params `quantization` (lm head and embedding quantised too, the schemes' default)."""
        return {"method": self.method, "group_size": self.group_size, "quantize_output": True,
                "quantize_embedding": True, **({"offset": True} if self.offset else {})}

    def bytes_per_weight(self) -> float:
        """Stored bytes a weight: the values, plus a float32 scale (and offset) per group or output channel."""
        value = 1.0 if self.method == "int8" else 0.5
        return value + (4 * (2 if self.offset else 1) / self.group_size if self.group_size else 0.0)


def weight_bytes(s: Shape, dtype_bytes: float = 2) -> int:
    """Bytes of weights one decode step reads: every linear of every layer, the norms and the output head (the
    embedding table gives one row per token, which is negligible and not counted)."""
    kv_dim = s.kv_heads * s.head_dim
    per_layer = s.hidden * (s.hidden + 2 * kv_dim) + s.hidden * s.hidden + 3 * s.hidden * s.intermediate + 2 * s.hidden
    return int(dtype_bytes * (s.layers * per_layer + s.vocab * s.hidden + s.hidden))


def kv_bytes(s: Shape, context: float, dtype_bytes: int = 2) -> float:
    """Bytes of K and V one sequence's decode step reads at `context` cached tokens."""
    return 2 * s.layers * s.kv_heads * s.head_dim * dtype_bytes * context


def step_bytes(s: Shape, batch: int, context: float, dtype_bytes: float = 2) -> float:
    return weight_bytes(s, dtype_bytes) + batch * kv_bytes(s, context)


def roofline_ms(s: Shape, batch: int, context: float, tbs: float, dtype_bytes: float = 2) -> float:
    """The least time of one decode step at `tbs` TB/s: its bytes over the bandwidth."""
    return step_bytes(s, batch, context, dtype_bytes) / (tbs * 1e12) * 1e3


def prefill_flops(s: Shape, tokens: int) -> float:
    """FLOPs of one sequence's prefill of `tokens` tokens: 2 per weight of every layer's linears per token, and causal
    attention (q k^T and p v over the keys at or before each query); the output head runs for the last token only."""
    kv_dim = s.kv_heads * s.head_dim
    linear = s.layers * (s.hidden * (s.hidden + 2 * kv_dim) + s.hidden * s.hidden + 3 * s.hidden * s.intermediate)
    attention = s.layers * 2 * 2 * s.hidden * tokens * (tokens + 1) / 2
    return 2.0 * linear * tokens + attention + 2.0 * s.vocab * s.hidden


def engine_rows(rows: list[dict], s: Shape, context: float, tbs: Optional[float], dtype_bytes: float = 2) -> list[dict]:
    """bench()'s rows with tokens/s, GB/s and the share of the roofline of each decode step."""
    out = []
    for r in rows:
        b, ms = r["batch"], r["decode_ms"]
        row = dict(batch=b, decode_ms=ms, decode_tok_s=b * 1e3 / ms,
                   gb_s=step_bytes(s, b, context, dtype_bytes) / (ms * 1e-3) / 1e9, throughput_tok_s=r["tps"],
                   prefill_ms=r["prefill_ms"], mem_gib=r["mem_gib"])
        row["roofline_fraction"] = roofline_ms(s, b, context, tbs, dtype_bytes) / ms if tbs else None
        out.append(row)
    return out


TARGETS = dict(batch1_roofline_fraction=0.85, batch64_roofline_fraction=0.75, int8_ratio=1.7, int4_ratio=2.6,
               prefill_peak_fraction=0.5)


def summarise(result: dict) -> dict:
    """Adds the batch-1 figures, the ratios and the issue's targets to `result` (its parts already in)."""
    rows = result["pmx"] if isinstance(result.get("pmx"), list) else []
    b1 = next((r for r in rows if r["batch"] == 1), None)
    b64 = next((r for r in rows if r["batch"] == 64), None)
    hf1 = next((r for r in result.get("transformers") or [] if isinstance(r, dict) and r["batch"] == 1), None)
    result["batch1_tok_s"] = b1["decode_tok_s"] if b1 else None
    result["roofline_fraction"] = b1["roofline_fraction"] if b1 else None
    result["batch64_roofline_fraction"] = b64["roofline_fraction"] if b64 else None
    result["speedup_vs_transformers"] = (b1["decode_tok_s"] / hf1["decode_tok_s"]) if b1 and hf1 else None
    for q in result.get("quant", []):
        q["ratio_to_fp16"] = q["decode_tok_s"] / b1["decode_tok_s"] if b1 and q.get("decode_tok_s") else None
    for v in result.get("variants", []):
        v["ms_vs_default"] = v["decode_ms"] / b1["decode_ms"] if b1 and v.get("decode_ms") else None
    best = {m: max((q["ratio_to_fp16"] for q in result.get("quant", []) if q.get("method") == m
                    and q.get("ratio_to_fp16")), default=None) for m in ("int8", "int4")}
    pre = result.get("prefill") or {}
    got = dict(batch1_roofline_fraction=result["roofline_fraction"],
               batch64_roofline_fraction=result["batch64_roofline_fraction"], int8_ratio=best["int8"],
               int4_ratio=best["int4"], prefill_peak_fraction=pre.get("peak_fraction"))
    result["targets"] = {k: dict(target=t, got=got[k], met=got[k] is not None and got[k] >= t)
                         for k, t in TARGETS.items()}
    return result


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x) -> str:
    return _f(None if x is None else 100 * x, ".1f")


def render_markdown(r: dict) -> str:
    v = r["versions"]
    s = Shape(**r["shape"])
    lines = [f"# GPU decode and prefill: {v['gpu']}, {r['date']}", "",
             f"{v['gpu']} ({r['hbm_part']}, {_f(r['hbm_tbs'], 'g')} TB/s HBM, copy measured "
             f"{_f(r.get('copy_tbs'), '.2f')} TB/s), driver {v['driver']}, CUDA {v['cuda']}, torch {v['torch']}, "
             f"triton {v['triton']}, transformers {v['transformers']}, vLLM {v['vllm']}.", "",
             f"Shape {r['shape_name']} ({s.layers} layers, dim {s.hidden}, {s.heads} heads, intermediate "
             f"{s.intermediate}, vocab {s.vocab}), random weights; {r['input_len']}-token prompts, {r['gen_len']} "
             f"generated tokens; a float16 decode step reads {weight_bytes(s) / 1e9:.2f} GB of weights (+ the KV "
             f"cache). pmx-runner: kernels={r['kernels']}, CUDA graphs {r['cuda_graphs']}, the decode fusions on "
             f"(norms in the linears, rotary in the qkv epilogue, split merge in attention).", "",
             f"**Batch-1 decode: {_f(r['batch1_tok_s'], '.1f')} tokens/s, {_pct(r['roofline_fraction'])}% of the "
             f"roofline, {_f(r['speedup_vs_transformers'], '.2f')}x transformers.**", "",
             "| target | wanted | got | met |", "|---|---|---|---|"]
    lines += [f"| {k} | {t['target']} | {_f(t['got'], '.3f')} | {'yes' if t['met'] else 'no'} |"
              for k, t in r["targets"].items()]
    lines += ["", "| batch | decode ms/step | decode tokens/s | GB/s | % of roofline | throughput tokens/s (with "
                  "prefill) |", "|---|---|---|---|---|---|"]
    for row in r["pmx"] if isinstance(r["pmx"], list) else []:
        lines.append(f"| {row['batch']} | {row['decode_ms']:.3f} | {row['decode_tok_s']:.1f} | {row['gb_s']:.0f} | "
                     f"{_pct(row['roofline_fraction'])} | {row['throughput_tok_s']:.1f} |")
    if isinstance(r["pmx"], str):
        lines.append(f"| - | {r['pmx']} |")
    for title, key, cols in (
            ("Batch-1 decode, the fusions (each session its own; ms_vs_default: against the batch-1 row above)",
             "variants", ("name", "decode_ms", "decode_tok_s", "roofline_fraction", "ms_vs_default", "error")),
            ("Batch-1 decode, weight-only quantised (ratio: tokens/s against float16's)", "quant",
             ("spec", "decode_ms", "decode_tok_s", "gb_s", "roofline_fraction", "ratio_to_fp16", "error")),
            ("Batch-1 decode in bfloat16", "bf16",
             ("name", "decode_ms", "decode_tok_s", "roofline_fraction", "error"))):
        rows = r.get(key)
        if not rows:
            continue
        rows = rows if isinstance(rows, list) else [rows]
        lines += ["", f"{title}:", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for x in rows:
            cells = []
            for c in cols:
                val = x.get(c)
                cells.append(_pct(val) + "%" if c == "roofline_fraction" and val is not None else
                             format(val, ".3f") if isinstance(val, float) else "" if val is None else str(val))
            lines.append("| " + " | ".join(cells) + " |")
    pre = r.get("prefill")
    if pre:
        if pre.get("error"):
            lines += ["", f"Prefill: {pre['error']}"]
        else:
            lines += ["", f"**Prefill of {pre['tokens']} tokens (batch 1, one step): {pre['ms']:.2f} ms, "
                          f"{pre['tflops']:.1f} TFLOP/s = {_pct(pre['peak_fraction'])}% of the dense float16 peak "
                          f"({_f(pre['peak_tflops'], 'g')} TFLOP/s), {_pct(pre['matmul_fraction'])}% of the matrix "
                          f"product measured here ({_f(pre['matmul_tflops'], '.0f')} TFLOP/s).**"]
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


def results_path(gpu: str, out_dir: Path, json_path: Optional[str] = None) -> Path:
    """out_dir/gpu-<gpu>-<date>.json, or json_path."""
    if json_path:
        return Path(json_path)
    return out_dir / f"gpu-{re.sub(r'[^A-Za-z0-9]+', '-', gpu).strip('-')}-{time.strftime('%Y-%m-%d')}.json"


def write_results(result: dict, js: Path) -> Path:
    """The JSON at `js` and the Markdown beside it (.md), each written whole (a temporary file renamed)."""
    js.parent.mkdir(parents=True, exist_ok=True)
    md = js.with_suffix(".md")
    for path, text in ((js, json.dumps(result, indent=1) + "\n"), (md, render_markdown(result))):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return md


# --- measurements ----------------------------------------------------------------------------------------------------
def versions(device: str) -> dict:
    import triton
    import transformers
    try:
        import vllm
        vllm_version = vllm.__version__
    except Exception:  # noqa: BLE001 - not installed, or broken: reported as such
        vllm_version = "not installed"
    driver = "none"
    if device == "cuda":
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            driver = "unknown"
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return dict(gpu=gpu, driver=driver, cuda=torch.version.cuda, torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, vllm=vllm_version)


def _params_file(s: Shape, work: Path, quantization: Optional[dict] = None, dtype: str = "float16") -> Path:
    """A bare pmx_params.json of shape `s` in `work` (bench's --random_weights takes it); a scheme the checkout does
    not have is refused here (runner.errors.PmxError)."""
    from runner.pmx.params import PmxParams
    work.mkdir(parents=True, exist_ok=True)
    PmxParams(model_type="llama", hidden_dim=s.hidden, intermediate_dim=s.intermediate, num_layers=s.layers,
              num_heads=s.heads, num_kv_heads=s.kv_heads, head_dim=s.head_dim, vocab_size=s.vocab, norm_eps=1e-5,
              rope_theta=10000.0, max_position_embeddings=4096, dtype=dtype, quantization=quantization).save(work)
    return work / "pmx_params.json"


def _hf_config(s: Shape):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
                       num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, vocab_size=s.vocab,
                       max_position_embeddings=4096, torch_dtype="float16")


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def transformers_decode(s: Shape, batches: list[int], input_len: int, gen_len: int, device: str) -> list[dict]:
    """transformers' generate (greedy, no early stop): decode tokens/s = tokens after the first / their time."""
    from transformers import LlamaForCausalLM
    with torch.device(device):
        model = LlamaForCausalLM(_hf_config(s)).to(torch.float16 if device == "cuda" else torch.float32).eval()
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    rows = []
    with torch.inference_mode():
        for b in batches:
            ids = torch.randint(3, s.vocab, (b, input_len), device=device)
            model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)       # warm-up
            times = []
            for n in (1, gen_len + 1):
                _sync(device)
                t0 = time.perf_counter()
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
                _sync(device)
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


def copy_tbs(device: str, gib: float = 2.0) -> Optional[float]:
    """A device-to-device copy of `gib` GiB: bytes read and written / time (TB/s), the median of 10 after a warm-up."""
    if device != "cuda":
        return None
    n = int(gib * 2**30) // 4
    a, b = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    a.normal_()
    times = []
    for i in range(11):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        if i:
            times.append(start.elapsed_time(end))
    del a, b
    _free()
    return 2 * n * 4 / (sorted(times)[len(times) // 2] * 1e-3) / 1e12


def matmul_tflops(device: str) -> float:
    """The float16 (CUDA; float32 on CPU) matrix product's rate measured here on random data: 8192^3 on CUDA (1024^3
    on CPU), the median of 10 after a warm-up."""
    n, dt = (8192, torch.float16) if device == "cuda" else (1024, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dt) for _ in range(2))
    times = []
    for i in range(11):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    del a, b
    _free()
    return 2 * n**3 / sorted(times)[len(times) // 2] / 1e12


def _part(name: str, fn):
    """fn()'s result, or {"error": ...} (printed) when it raises: one part's failure leaves the others."""
    t0 = time.perf_counter()
    print(f"gpu_generate: {name} ...", file=sys.stderr, flush=True)
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - recorded as the part's result
        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"gpu_generate: {name} failed: {msg}", file=sys.stderr, flush=True)
        out = {"error": msg}
    _free()
    print(f"gpu_generate: {name} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return out


VARIANTS = {  # name -> EngineConfig changes from the defaults (every decode fusion on)
    "none": dict(norm_in_linears=False, rotary_in_qkv=False, merge_in_attention=False),
    "-norm": dict(norm_in_linears=False),
    "-rotary": dict(rotary_in_qkv=False),
    "-merge": dict(merge_in_attention=False),
    "+pdl": dict(pdl=True),
    "cublas": dict(decode_linears=False),
}


def main(layers: Optional[int] = None, batches: str = "1 16 64", input_len: int = 8, gen_len: int = 64,
         hf_batches: str = "1", vllm: bool = False, hbm_tbs: Optional[float] = None, kernels: str = "auto",
         cuda_graphs: bool = True, variants: str = ",".join(VARIANTS), quant: str = "int8 int4g128 int8g32 int4g32o",
         bf16: bool = True, prefill_len: int = 2048, eager: bool = False, device: str = "cuda", shape: str = "7b",
         out_dir: str = str(RESULTS), json_path: Optional[str] = None) -> None:
    """Measures and writes the results (see the module's docstring).

    Args:
        layers: transformer layers (default: the shape's; fewer for a quick look).
        batches: float16 batch sizes.
        input_len: prompt tokens per sequence.
        gen_len: tokens generated per sequence.
        hf_batches: transformers' (and vLLM's) batch sizes ("" for none).
        vllm: also measure vLLM when it imports.
        hbm_tbs: the GPU's HBM bandwidth in TB/s (default: from its name).
        kernels: pmx-runner's kernels (auto: Triton on CUDA).
        cuda_graphs: pmx-runner replays decode steps from CUDA graphs.
        variants: decode-fusion variants at batch 1, comma-separated (none, -norm, -rotary, -merge, +pdl, cublas;
            "" for none).
        quant: weight-only schemes at batch 1, space- or comma-separated ("" for none).
        bf16: also batch 1 in bfloat16.
        prefill_len: prompt tokens of the prefill part (0: none).
        eager: also batch 1 without CUDA graphs.
        device: cuda, or cpu (a rehearsal of the script on a small --shape).
        shape: 7b (Llama-2-7B) or tiny.
        out_dir: where the JSON and the Markdown go.
        json_path: the JSON's path instead (the Markdown beside it).
    """
    from runner.args import int_list, items, parse_bool, parse_float
    vllm, cuda_graphs, bf16, eager = (parse_bool(n, v) for n, v in (("vllm", vllm), ("cuda_graphs", cuda_graphs),
                                                                     ("bf16", bf16), ("eager", eager)))
    hbm_tbs = None if hbm_tbs is None else parse_float("hbm_tbs", hbm_tbs)
    if device not in ("cuda", "cpu") or shape not in SHAPES:
        raise SystemExit(f"--device cuda|cpu and --shape {'|'.join(SHAPES)}; got {device!r}, {shape!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_generate.py --device cuda needs a CUDA GPU (torch.cuda.is_available() is False); "
                         "--device cpu --shape tiny rehearses it")
    variant_list = [v for v in items(variants)]
    if set(variant_list) - set(VARIANTS):
        raise SystemExit(f"--variants: some of {', '.join(VARIANTS)}; got {variants!r}")
    quants = [Quant.parse(q) for q in items(quant)]
    s = replace(SHAPES[shape], **({} if layers is None else {"layers": int(layers)}))
    batch_list = int_list(batches, "batches", minimum=1, allow_empty=False)
    hf_list = int_list(hf_batches, "hf_batches", minimum=1)
    v = versions(device)
    part_tbs, part = hbm_bandwidth(v["gpu"]) if device == "cuda" else (None, "cpu: no HBM roofline")
    tbs = hbm_tbs if hbm_tbs is not None else part_tbs
    if tbs is None:
        warnings.warn(f"{part}: no roofline (give --hbm_tbs)")
    plan = Plan(s, shape, device, kernels, cuda_graphs, batch_list, variant_list, quants, bf16, eager, prefill_len,
                hf_list, vllm, input_len, gen_len, tbs, part, v)
    js = results_path(v["gpu"], Path(out_dir), json_path)
    with tempfile.TemporaryDirectory(prefix="pmx-gpu-bench-") as tmp:  # (written after every part: a run cut short
        result = measure(Path(tmp), plan, lambda r: write_results(summarise(r), js))  # keeps what it measured)
    md = write_results(result, js)
    print(render_markdown(result))
    print(f"wrote {js} and {md}", file=sys.stderr)


@dataclass(frozen=True)
class Plan:
    """What main measures (its arguments, checked)."""
    shape: Shape
    shape_name: str
    device: str
    kernels: str
    cuda_graphs: bool
    batches: list
    variants: list
    quants: list
    bf16: bool
    eager: bool
    prefill_len: int
    hf_batches: list
    vllm: bool
    input_len: int
    gen_len: int
    tbs: Optional[float]
    hbm_part: str
    versions: dict


def measure(work: Path, p: Plan, save=lambda result: None) -> dict:
    """Every part of the plan, in `work` (their pmx_params.json files); the result, summarised. save(result) after
    each part."""
    from runner.config import EngineConfig
    from runner.engine.bench import bench
    from runner.errors import PmxError
    s, device, tbs, input_len, gen_len = p.shape, p.device, p.tbs, p.input_len, p.gen_len
    context = input_len + gen_len / 2  # the mean cached tokens of a decode step
    fp16 = str(_params_file(s, work / "fp16"))
    common = dict(random_weights=True, input_len=input_len, gen_len=gen_len, progress=True)
    config = EngineConfig(device=device, dtype="float16" if device == "cuda" else "float32", kernels=p.kernels,
                          cuda_graphs=p.cuda_graphs)

    def batch1(params: str, dtype_bytes: float = 2, name: str = "", **changes) -> dict:
        row = engine_rows(bench(params, batch_sizes=[1], config=replace(config, **changes), **common), s, context,
                          tbs, dtype_bytes)[0]
        return {"name": name, **row}

    t_start = time.perf_counter()
    result = dict(date=time.strftime("%Y-%m-%d"), versions=p.versions, device=device, shape_name=p.shape_name,
                  hbm_tbs=tbs, hbm_part=p.hbm_part, shape=asdict(s), input_len=input_len, gen_len=gen_len,
                  kernels=p.kernels, cuda_graphs=p.cuda_graphs, weight_bytes=weight_bytes(s), mean_context=context)
    result["copy_tbs"] = _part("HBM copy", lambda: copy_tbs(device))
    rows = _part("float16 batches", lambda: engine_rows(bench(fp16, batch_sizes=p.batches, config=config, **common),
                                                        s, context, tbs))
    result["pmx"] = rows if isinstance(rows, list) else rows["error"]
    save(result)
    result["quant"] = []
    for q in p.quants:
        try:
            qp = str(_params_file(s, work / q.spec, q.as_dict()))
        except PmxError as e:  # a scheme this checkout does not have
            result["quant"].append({"spec": q.spec, "method": q.method, "error": f"not in this checkout: {e}"})
            continue
        got = _part(f"quant {q.spec}", lambda qp=qp, q=q: batch1(qp, q.bytes_per_weight(), q.spec))
        result["quant"].append({**got, "spec": q.spec, "method": q.method, "bytes_per_weight": q.bytes_per_weight()})
        save(result)
    if p.prefill_len:
        result["prefill"] = _part("prefill", lambda: prefill(fp16, s, p.prefill_len, config, device,
                                                             p.versions["gpu"]))
        save(result)
    if p.bf16:  # (on CPU the packed linears take float32 activations: plain ones for a bfloat16 rehearsal)
        result["bf16"] = _part("bfloat16", lambda: batch1(str(_params_file(s, work / "bf16", dtype="bfloat16")),
                                                          name="bfloat16", dtype="bfloat16",
                                                          **({"prepack": False} if device == "cpu" else {})))
        save(result)
    # the targets' figures first (a run cut short keeps them), the fusions' and transformers' after
    result["variants"] = []
    for n in p.variants:
        result["variants"].append(_part(f"variant {n}", lambda n=n: batch1(fp16, name=n, **VARIANTS[n])) | {"name": n})
        save(result)
    if p.eager and 1 in p.batches:
        result["pmx_eager_batch1"] = _part("eager batch 1", lambda: batch1(fp16, name="eager", cuda_graphs=False))
    if p.hf_batches:
        hf = _part("transformers", lambda: transformers_decode(s, p.hf_batches, input_len, gen_len, device))
        result["transformers"] = hf if isinstance(hf, list) else hf["error"]
        if p.vllm:
            result["vllm"] = vllm_decode(s, p.hf_batches, input_len, gen_len, work)
    result["seconds"] = time.perf_counter() - t_start
    return summarise(result)


def prefill(params: str, s: Shape, tokens: int, config, device: str, gpu: str) -> dict:
    """One `tokens`-token prompt prefilled in one step (no chunking), batch 1: ms (bench's prefill time of the second
    of two runs), TFLOP/s, and its shares of the dense float16 peak and of the matrix product measured here."""
    from runner.engine.bench import bench
    mm = matmul_tflops(device)
    row = bench(params, random_weights=True, batch_sizes=[1], input_len=tokens, gen_len=1, progress=True,
                config=replace(config, context_chunking=False, max_num_batched_tokens=None))[0]
    tflops = prefill_flops(s, tokens) / (row["prefill_ms"] * 1e-3) / 1e12
    peak = fp16_peak(gpu) if device == "cuda" else None
    return dict(tokens=tokens, ms=row["prefill_ms"], tflops=tflops, flops=prefill_flops(s, tokens), peak_tflops=peak,
                peak_fraction=tflops / peak if peak else None, matmul_tflops=mm, matmul_fraction=tflops / mm)


if __name__ == "__main__":
    fire.Fire(main)
