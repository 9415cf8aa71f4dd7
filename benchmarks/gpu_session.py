#!/usr/bin/env python3
"""The Python stages of benchmarks/gpu_session.sh that are not a benchmark of their own, and its report.

    python benchmarks/gpu_session.py env --json_path W/env.json          the machine: GPU, driver, CUDA, torch,
                                                                        triton, transformers, Python, cores, and the
                                                                        packages the stages import that are missing
    python benchmarks/gpu_session.py serve_model --output_dir W/serve    a PMX directory of the Llama-2-7B shape
                                                                        (--shape tiny: a small one): pmx_params.json
                                                                        and a tokenizer, for `serve --random_weights`
    python benchmarks/gpu_session.py gloo --model DIR --json_path W/gloo.json [--device cuda]
                                                                        two ranks sharing the device over gloo against
                                                                        one: the greedy ids of a real checkpoint (they
                                                                        must be the same), tokens/s of each, and the
                                                                        7B shape's batch-1 decode (random weights) at
                                                                        TP=1 and TP=2 (--bench_shape, "" for none)
    python benchmarks/gpu_session.py report --work W --out_dir OUT       every stage's JSON (env, junit, decode, serve,
                                                                        gloo, stage times) into OUT/gpu-session-<gpu>-
                                                                        <date>.json and .md (the table), what a lent
                                                                        GPU's run brings back

Each writes its JSON whole (a temporary file renamed) and exits 0 when it ran; a measurement that fails is recorded
in the JSON with its error (the report says what is missing).
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Optional

import fire

REPO = Path(__file__).resolve().parents[1]
# what the stages import beyond torch (the device's image lacks some: gpu_session.sh installs them from .whl/)
STAGE_MODULES = ("triton", "transformers", "fire", "safetensors", "tokenizers", "sentencepiece", "tiktoken", "jinja2",
                 "starlette", "uvicorn", "httptools", "uvloop", "pydantic", "msgspec", "prometheus_client", "httpx",
                 "pytest", "xdist", "pytest_timeout")


def _write_json(path: str, data: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(out)


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


# --- env -------------------------------------------------------------------------------------------------------------
CPU_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16",
                "amx_int8")  # the ones the C++ kernels' branches (-march=native) or their peers' tell apart


def host_cpu() -> dict:
    """The host's processor: its model and which of CPU_FEATURES it has (the C++ CPU kernels build for it)."""
    fields = {}  # the first processor's
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    return {"model": fields.get("model name") or platform.processor(),
            "features": [f for f in CPU_FEATURES if f in flags]}


def env(json_path: str) -> None:
    """The machine and the versions every figure is reported with; the stages' modules that do not import."""
    import torch
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(),
                 "cores": os.cpu_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
                 "cuda_available": torch.cuda.is_available()}
    versions, missing = {}, {}
    for name in STAGE_MODULES:
        try:
            mod = importlib.import_module(name)
            with warnings.catch_warnings():  # (some warn that __version__ is deprecated)
                warnings.simplefilter("ignore")
                versions[name] = getattr(mod, "__version__", "?")
        except Exception as e:  # noqa: BLE001 - a missing or broken package is what this reports
            missing[name] = _first_line(e)
    out["modules"], out["missing"] = versions, missing
    out["host_cpu"] = host_cpu()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out["gpu"] = {"name": p.name, "sms": p.multi_processor_count, "memory_gib": round(p.total_memory / 2**30, 1),
                      "capability": f"{p.major}.{p.minor}"}
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
                                "clocks.max.mem", "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            name, driver, mem, sm, memclk = (x.strip() for x in q.stdout.strip().splitlines()[0].split(","))
            out["gpu"].update(driver=driver, nvidia_smi_memory=mem, max_sm_clock=sm, max_mem_clock=memclk)
        except (OSError, IndexError, ValueError, subprocess.SubprocessError) as e:
            out["gpu"]["driver"] = f"unknown ({_first_line(e)})"
    else:
        out["gpu"] = {"name": "none (no CUDA device)", "driver": "none"}
    _write_json(json_path, out)
    print(f"env: {out['gpu']['name']}, driver {out['gpu'].get('driver')}, CUDA {out['cuda']}, torch {out['torch']}, "
          f"triton {versions.get('triton')}, transformers {versions.get('transformers')}, Python {out['python']}, "
          f"{out['cores']} cores; missing: {', '.join(missing) or 'none'}")


# --- serve_model ------------------------------------------------------------------------------------------------------
def serve_model(output_dir: str, shape: str = "7b") -> None:
    """A PMX directory of `shape` (benchmarks/gpu_generate.py's SHAPES) with no shards: pmx_params.json (float16) and
    a tokenizer.json of its vocabulary, which `python -m runner serve --random_weights` serves."""
    from gpu_generate import SHAPES, _params_file
    from runner.pmx.random_model import _tokenizer_json
    if shape not in SHAPES:
        raise SystemExit(f"--shape: one of {', '.join(SHAPES)}, got {shape!r}")
    out = Path(output_dir)
    _params_file(SHAPES[shape], out)
    tmp = out / "tokenizer.json.tmp"
    tmp.write_text(_tokenizer_json(SHAPES[shape].vocab))
    tmp.replace(out / "tokenizer.json")
    print(f"serve_model: {out} ({shape}, random weights when served with --random_weights)")


# --- gloo ------------------------------------------------------------------------------------------------------------
def _launch(ranks: int, args: list, timeout: float, running: list) -> subprocess.CompletedProcess:
    """`python args` on one rank, or under torchrun on `ranks` (its own process group, ended on timeout; its id in
    `running` meanwhile, for the stage's SIGTERM to end it too)."""
    cmd = [sys.executable, *args] if ranks == 1 else \
        [sys.executable, "-m", "runner.parallel.torchrun", "--standalone", "--nproc_per_node", str(ranks), *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
                            start_new_session=True)
    running.append(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n(timed out after {timeout:.0f} s)"
    finally:
        running.remove(proc.pid)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _demo(ckpt: Path, ranks: int, device: str, tokens: int, timeout: float, running: list) -> dict:
    flags = ["--comm_backend", "gloo"] if ranks > 1 else []
    res = _launch(ranks, [str(REPO / "scripts" / "Demo.py"), "--ckpt_dir", str(ckpt), "--prompt", "Once upon a time",
                          "--max_gen_len", str(tokens), "--show_ids", "--device", device, *flags], timeout, running)
    ids = [json.loads(m) for m in re.findall(r"^ids: (\[.*\])$", res.stdout, re.M)]
    speed = re.findall(r"\(([0-9.]+) tokens/s", res.stderr)
    return {"ranks": ranks, "returncode": res.returncode, "ids": ids[0] if len(ids) == 1 else None,
            "tokens_s": float(speed[-1]) if speed else None,
            "error": None if res.returncode == 0 and len(ids) == 1 else res.stderr.strip()[-1500:]}


def _bench(params: Path, ranks: int, device: str, timeout: float, running: list) -> dict:
    flags = ["--comm_backend", "gloo"] if ranks > 1 else []
    res = _launch(ranks, ["-m", "runner", "bench", "--model", str(params), "--random_weights", "--batch_sizes", "1",
                          "--gen_len", "16", "--device", device, *flags], timeout, running)
    rows = [ln.split(",") for ln in res.stdout.splitlines() if re.match(r"^1,[0-9.]+,", ln)]
    if res.returncode or not rows:
        return {"ranks": ranks, "error": res.stderr.strip()[-1500:] or f"exit {res.returncode}"}
    return {"ranks": ranks, "decode_ms": float(rows[0][2]), "decode_tok_s": 1e3 / float(rows[0][2])}


def gloo(model: str, json_path: str, device: str = "cuda", tokens: int = 40, bench_shape: str = "7b",
         timeout: float = 120) -> None:
    """Two ranks on one device with --comm_backend gloo against one rank: the greedy ids of the real checkpoint
    `model` (an HF directory, converted here; they must be the same) and the batch-1 decode of `bench_shape` with
    random weights."""
    import tempfile

    from gpu_generate import SHAPES, _params_file
    from runner.pmx.convert import convert, reshard
    out: dict = {"model": model, "device": device, "tokens": tokens}
    running: list = []

    def on_term(*_):  # the stage's limit: the ranks in their own sessions end with it
        for pid in running:
            os.killpg(pid, signal.SIGKILL)
        sys.exit(124)
    signal.signal(signal.SIGTERM, on_term)
    with tempfile.TemporaryDirectory(prefix="pmx-gloo-") as tmp:
        work = Path(tmp)
        try:
            convert(model, str(work / "tp1"), progress=False)
            reshard(str(work / "tp1"), str(work / "tp2"), 2, progress=False)
            out["tp1"] = _demo(work / "tp1", 1, device, tokens, timeout, running)
            out["tp2_gloo"] = _demo(work / "tp2", 2, device, tokens, timeout, running)
            out["same_ids"] = out["tp1"]["ids"] is not None and out["tp1"]["ids"] == out["tp2_gloo"]["ids"]
        except Exception as e:  # noqa: BLE001 - recorded
            out["error"] = _first_line(e)
        _write_json(json_path, out)  # (the ids first: a stage cut short during the benchmark keeps them)
        if bench_shape:
            params = _params_file(SHAPES[bench_shape], work / "bench")
            out["bench"] = {"shape": bench_shape, "tp1": _bench(params, 1, device, timeout, running),
                            "tp2_gloo": _bench(params, 2, device, timeout, running)}
    _write_json(json_path, out)
    print(f"gloo: TP=2 over gloo gives TP=1's ids: {out.get('same_ids')}; tokens/s "
          f"{out.get('tp1', {}).get('tokens_s')} (TP=1) and {out.get('tp2_gloo', {}).get('tokens_s')} (TP=2); "
          f"bench {json.dumps(out.get('bench'))}")


# --- report ----------------------------------------------------------------------------------------------------------
def _load(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tests_from_log(path: Path) -> Optional[dict]:
    """The outcome lines of a `pytest -v` log (a run cut short writes no junit XML)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    outcomes = re.findall(r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (tests/\S+)", text)
    if not outcomes:
        return None
    count = {k: sum(o == k for o, _ in outcomes) for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    return {"tests": len(outcomes), "failures": count["FAILED"], "errors": count["ERROR"], "skipped": count["SKIPPED"],
            "failed": [t for o, t in outcomes if o in ("FAILED", "ERROR")], "from": "the log (no junit XML: cut short)"}


def _junit(path: Path) -> Optional[dict]:
    """Tests, failures, errors, skips and the failing tests' names of a pytest junit XML (else of its -v log)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return _tests_from_log(path.with_name("tests.log"))
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    total["failed"] = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s
                       if c.find("failure") is not None or c.find("error") is not None]
    return total


def _serve_rows(serve: Optional[dict]) -> list[dict]:
    """Median figures per (system, concurrency) of serve_bench's sweep, or of what a sweep cut short had measured
    (its `sweep_partial` runs: the stage's limit ends it, and the figures it has are kept)."""
    import statistics
    if not serve or ("sweep" not in serve and not serve.get("sweep_partial")):
        return []
    runs = serve["sweep"]["runs"] if "sweep" in serve else serve["sweep_partial"]
    levels = serve["sweep"]["levels"] if "sweep" in serve else sorted({x["concurrency"] for x in runs})
    systems = serve["sweep"]["systems"] if "sweep" in serve else list(dict.fromkeys(x["system"] for x in runs))
    rows = []
    for c in levels:
        for s in systems:
            xs = [x for x in runs if x["system"] == s and x["concurrency"] == c]
            if xs:
                rows.append({"system": s, "concurrency": c, **{k: statistics.median(x[k] for x in xs) for k in (
                    "out_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")}})
    return rows


def report(work: str, out_dir: str) -> None:
    """OUT/gpu-session-<gpu>-<date>.json (every stage's figures) and .md (the tables) from the stages' files in
    `work`: env.json, junit.xml, decode.json, serve.json, gloo.json, cpu.json, stages.tsv (name, exit status, seconds,
    limit)."""
    w = Path(work)
    env_ = _load(w / "env.json") or {}
    stages = []
    if (w / "stages.tsv").exists():
        for line in (w / "stages.tsv").read_text().splitlines():
            name, rc, secs, limit = line.split("\t")
            stages.append({"stage": name, "exit": int(rc), "seconds": float(secs), "limit_s": float(limit)})
    decode, serve, gloo_ = _load(w / "decode.json"), _load(w / "serve.json"), _load(w / "gloo.json")
    cpu = _load(w / "cpu.json")
    gpu = (env_.get("gpu") or {}).get("name", "unknown")
    result = {"date": time.strftime("%Y-%m-%d"), "env": env_, "stages": stages, "tests": _junit(w / "junit.xml"),
              "decode": decode, "serve": {"rows": _serve_rows(serve), "hf": (serve or {}).get("sweep", {}).get("hf"),
                                          "skipped": (serve or {}).get("skipped")} if serve else None,
              "gloo": gloo_,
              "cpu": None if not cpu else {k: cpu.get(k) for k in ("shape", "threads", "read_gbps", "median", "cpu",
                                                                  "skipped")}}
    if decode:
        result["roofline_fraction"] = decode.get("roofline_fraction")
        result["targets"] = decode.get("targets")
    stem = f"gpu-session-{re.sub(r'[^A-Za-z0-9]+', '-', gpu).strip('-')}-{result['date']}"
    out = Path(out_dir)
    _write_json(str(out / f"{stem}.json"), result)
    md = render(result)
    (out / f"{stem}.md").write_text(md)
    print(md)
    print(f"report: {out / stem}.json and .md")


def _host_cpu(env_: dict) -> str:
    """' (model: features)' of the host's processor where env recorded it."""
    cpu = env_.get("host_cpu")
    return f" ({cpu.get('model')}: {' '.join(cpu.get('features') or []) or '-'})" if cpu else ""


def render(r: dict) -> str:
    from gpu_generate import render_markdown
    env_, gpu = r["env"], (r["env"].get("gpu") or {})
    lines = [f"# GPU session: {gpu.get('name')}, {r['date']}", "",
             f"{gpu.get('name')} ({gpu.get('sms')} SMs, {gpu.get('memory_gib')} GiB), driver {gpu.get('driver')}, "
             f"CUDA {env_.get('cuda')}, torch {env_.get('torch')}, triton {(env_.get('modules') or {}).get('triton')}, "
             f"transformers {(env_.get('modules') or {}).get('transformers')}, Python {env_.get('python')}, "
             f"{env_.get('cores')} cores{_host_cpu(env_)}. `bash benchmarks/gpu_session.sh` (stages below).", "",
             "| stage | exit | seconds | limit |", "|---|---|---|---|"]
    lines += [f"| {s['stage']} | {s['exit']} | {s['seconds']:.0f} | {s['limit_s']:.0f} |" for s in r["stages"]]
    spent, budget = sum(s["seconds"] for s in r["stages"]), sum(s["limit_s"] for s in r["stages"])
    lines += ["", f"Total {spent:.0f} s of {budget:.0f} s budgeted. Missing modules: "
                  f"{', '.join(env_.get('missing') or {}) or 'none'}."]
    t = r.get("tests")
    lines += ["", "**GPU tests:** " + ("no junit report (a rehearsal collects them only)" if not t else
                                       f"{t['tests']} tests, {t['failures']} failures, {t['errors']} errors, "
                                       f"{t['skipped']} skipped" + (f"; failed: {', '.join(t['failed'][:20])}"
                                                                    if t["failed"] else ""))]
    if r.get("decode"):
        lines += ["", render_markdown(r["decode"]).replace("# GPU decode and prefill", "## Decode and prefill", 1)]
    else:
        lines += ["", "## Decode and prefill", "", "no figures (the stage failed or did not run: see its log)"]
    lines += ["", "## Serving (benchmarks/serve_bench.py sweep)", ""]
    rows = (r.get("serve") or {}).get("rows") or []
    if rows:
        lines += ["| C | system | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {x['concurrency']} | {x['system']} | {x['out_tok_s']:.1f} | {x['ttft_p50_ms']:.0f} | "
                  f"{x['ttft_p99_ms']:.0f} | {x['itl_p50_ms']:.1f} | {x['itl_p99_ms']:.1f} |" for x in rows]
        hf = (r.get("serve") or {}).get("hf")
        if hf:
            lines += ["", f"hf: transformers {hf['transformers']} on {hf['device']}, {hf['batching']}."]
    else:
        lines.append("no figures (the stage failed or did not run: see its log)")
    g = r.get("gloo") or {}
    lines += ["", "## Two ranks on one device (--comm_backend gloo)", ""]
    if g:
        err = f"; error: {g['error']}" if g.get("error") else ""
        lines.append(f"{g.get('model')}: TP=2 over gloo gives TP=1's {g.get('tokens')} greedy ids: "
                     f"**{g.get('same_ids')}** (TP=1 {(g.get('tp1') or {}).get('tokens_s')} tokens/s, TP=2 "
                     f"{(g.get('tp2_gloo') or {}).get('tokens_s')} tokens/s){err}.")
        b = g.get("bench") or {}
        if b:
            lines.append(f"{b.get('shape')} shape, batch-1 decode: TP=1 {json.dumps(b.get('tp1'))}; TP=2 gloo "
                         f"{json.dumps(b.get('tp2_gloo'))}.")
    else:
        lines.append("no figures (the stage failed or did not run: see its log)")
    lines += ["", "## The host CPU (benchmarks/cpu_peers.py: the CPU engine on the GPU machine's processor)", ""]
    c = r.get("cpu") or {}
    if c.get("median"):
        reads = c.get("read_gbps") or []
        read = sorted(reads)[len(reads) // 2] if reads else None
        shape = c.get("shape") or {}
        lines += [f"{(c.get('cpu') or {}).get('processor')}, {c.get('threads')} threads; shape {shape.get('name')} "
                  f"(random weights); the box read {read if read is None else f'{read:.1f}'} GB/s "
                  f"({c.get('threads')} threads). Tokens/s, medians of the rounds:", "",
                  "| system | decode b=1 | decode b=16 | prefill 512 |", "|---|---|---|---|"]
        lines += [f"| {name} | " + " | ".join(f"{m.get(k, float('nan')):.1f}" for k in
                                            ("decode_b1", "decode_b16", "prefill_512")) + " |"
                  for name, m in c["median"].items()]
        lines += [f"skipped {name}: {why}" for name, why in (c.get("skipped") or {}).items()]
    else:
        lines.append("no figures (the stage failed or did not run: see its log)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    fire.Fire({"env": env, "serve_model": serve_model, "gloo": gloo, "report": report})
