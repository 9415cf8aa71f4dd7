#!/usr/bin/env python3
"""pmx-runner beside llama.cpp on the same GGUF files: llama.cpp runs the file, pmx-runner its conversion
(`python -m runner convert --input_dir FILE.gguf`, Q8_0 / Q4_0 / Q4_1 kept as the same integers and scales), so the
comparison is of the engines alone.

Models (`--models`, comma-separated):
  smollm2   ../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf (a real model: Q4_1 linears,
            Q8_0 embedding = tied lm head)
  q8_0      benchmarks/cpu_peers.py's gqa shape (178M: dim 1024, 10 layers, 16 / 4 heads, intermediate 2816, vocab
            32000, random weights), converted by llama.cpp's convert_hf_to_gguf.py to F32 and quantised by
            `llama-quantize --pure` to Q8_0 (every matrix Q8_0, the lm head and embedding too)
  q4_0      the same, `llama-quantize --pure` Q4_0

    python benchmarks/gguf_peers.py speed [--models smollm2,q8_0,q4_0] [--points decode_b1,decode_b16,prefill_512]
        [--pairs 6] [--tokens 64] [--threads 2] [--json_path benchmarks/results/gguf_peers_speed-DATE.json]
    python benchmarks/gguf_peers.py perplexity [--model smollm2] [--text tests/data/story.txt] [--ctx 128]
    python benchmarks/gguf_peers.py q4_1 [--pairs 6]     # SmolLM2's Q4_1: exact (int4 + offsets) vs dequantised
    python benchmarks/gguf_peers.py layout               # llama.cpp's own converter's q/k layout, read back

`speed`: per model and point, pmx-runner TP=1 (this process, THREADS threads) and llama.cpp (-t THREADS) take turns,
a slice each, `pairs` times, who goes first alternating; it prints the median tokens/s of each and the median of the
per-pair ratios (pmx / llama.cpp). Points as benchmarks/cpu_peers.py's: decode_b1 (`tokens` tokens after an 8-token
prompt: llama-bench -n TOKENS -d 8), decode_b16 (16 sequences, TOKENS / 2 tokens each: llama-batched-bench -npp 8
-ntg TOKENS/2 -npl 16), prefill_512 (a 512-token prompt: llama-bench -p 512 -n 0). llama.cpp keeps its f16 KV cache
(its default), pmx-runner a float32 one. Also each system's peak RSS (pmx: this process after loading and one
generation, /proc; llama.cpp: /usr/bin/time of one llama-bench run).

`perplexity`: `llama-perplexity -c CTX` (chunks of CTX tokens, the second half of each scored) against `python -m
runner perplexity --window CTX --scoring chunks` (the same recipe) on the same file and text; and `runner perplexity
--window CTX --stride CTX/2` (sliding windows: every token after the first scored once), another recipe's number.

`q4_1`: SmolLM2's Q4_1 linears kept exact (int4 in groups of 32 with offsets) or dequantised to float32 (what
convert_gguf does for types it does not keep), each beside llama.cpp on the same file: batch-1 decode and 512-token
prefill (paired as `speed`), peak RSS, file size and perplexity.

`layout`: the gqa shape as an HF checkpoint and as llama.cpp's F32 GGUF of it (its converter permutes Llama's q/k
rows), each converted to PMX: the same greedy tokens and logits (checks the q/k layout read from a real llama.cpp file).

Every figure goes to the JSON (default benchmarks/results/gguf_peers_COMMAND-DATE.json) with the machine, the load
averages, the versions and llama.cpp's build. llama.cpp is benchmarks/cpu_peers.py's build (the llama-cpp-python
sdist, built once under ~/.cache/pmx-runner/llama.cpp/build; `--llama_cpp DIR` for another); the files and
conversions are cached under --workdir.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import fire

import cpu_peers as peers

REPO = peers.REPO
SMOLLM2 = REPO.parent / "shared" / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
WORK = peers.CACHE / "gguf-peers"
TOOLS = ("llama-bench", "llama-batched-bench", "llama-perplexity", "llama-quantize")
POINTS = ("decode_b1", "decode_b16", "prefill_512")


def _args(threads: int, workdir: str, llama_cpp) -> dict:
    # the engine's sessions set their own thread count (cores / ranks) unless told: this process's and pmx_rss's too
    os.environ["PMX_NUM_THREADS"] = str(threads)
    work = Path(workdir).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    return dict(work=work, threads=threads, llama_cpp=llama_cpp or os.environ.get("PMX_LLAMA_CPP"), install=True)


def _bindir(a: dict) -> Path:
    return peers._llama_cpp_bin(peers._llama_cpp_source(), a["llama_cpp"], TOOLS)


def _gqa_f32(a: dict) -> Path:
    """llama.cpp's F32 GGUF of the gqa shape (cpu_peers' random checkpoint, its converter), made once."""
    from runner.pmx.random_model import make_random_model
    sub = {**a, "work": a["work"] / "gqa", "hf": a["work"] / "gqa" / "hf"}
    if not (sub["hf"] / "config.json").exists():
        make_random_model(str(sub["hf"]), **peers.SHAPES["gqa"], overwrite=True)
    return peers._llama_cpp_model(sub, None, ("llama-bench",))[1]


def gguf_of(name: str, a: dict) -> Path:
    """The GGUF file of model `name` (made once: `llama-quantize --pure` of the F32 file for q8_0 / q4_0)."""
    if name == "smollm2":
        if not SMOLLM2.is_file():
            raise SystemExit(f"{SMOLLM2} not found (../shared/models beside the project)")
        return SMOLLM2
    f32 = _gqa_f32(a)
    out = f32.with_name(f"model-{name}-pure.gguf")
    if not out.exists():
        peers._run([_bindir(a) / "llama-quantize", "--pure", f32, out.with_suffix(".tmp"), name.upper(),
                    a["threads"]], "llama-quantize")
        out.with_suffix(".tmp").rename(out)
    return out


def pmx_of(gguf: Path, a: dict, exact: tuple = ("Q8_0", "Q4_0", "Q4_1")) -> Path:
    """pmx-runner's conversion of `gguf` (made once per file and kept types)."""
    from runner.pmx.convert import convert_gguf
    from runner.pmx.gguf import gguf_files
    tag = "exact" if len(exact) == 3 else "keep-" + "-".join(exact) if exact else "dequantised"
    out = a["work"] / f"pmx-{gguf.stem}-{tag}"
    if not (out / "pmx_params.json").exists():
        convert_gguf(gguf_files(gguf), str(out), overwrite=True, progress=False, exact=exact, report=print)
    return out


def _llama_rate(a: dict, gguf: Path, point: str, tokens: int) -> float:
    """llama.cpp's tokens/s of one point on `gguf` (one run of its bench tool)."""
    b, t = _bindir(a), str(a["threads"])
    if point == "decode_b1":
        return peers._llama_bench(b, gguf, t, "-p", "0", "-n", str(tokens), "-d", str(peers.PROMPT))["avg_ts"]
    if point == "prefill_512":
        return peers._llama_bench(b, gguf, t, "-p", str(peers.LONG_PROMPT), "-n", "0")["avg_ts"]
    out = peers._run([b / "llama-batched-bench", "-m", gguf, "-c", "4096", "-npp", str(peers.PROMPT), "-ntg",
                      str(tokens // 2), "-npl", "16", "-t", t, "--output-format", "jsonl"], "llama-batched-bench")
    return [json.loads(ln) for ln in (out.stdout + out.stderr).splitlines() if '"speed_tg"' in ln][0]["speed_tg"]


def _llama_rss(a: dict, gguf: Path) -> float:
    """Peak RSS (MiB) of one llama-bench run on `gguf` (a short decode)."""
    res = subprocess.run(["/usr/bin/time", "-v", str(_bindir(a) / "llama-bench"), "-m", str(gguf), "-t",
                          str(a["threads"]), "-r", "1", "-p", "0", "-n", "4", "-o", "json"], capture_output=True,
                         text=True)
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", res.stderr)
    return int(m.group(1)) / 1024 if m else float("nan")


def pmx_rss(model: str, threads: int = 2) -> None:
    """(run in a subprocess by _pmx_rss) Peak RSS of this process after loading `model` and one generation."""
    import torch
    torch.set_num_threads(threads)
    eng = peers.open_engine(model)
    eng.generate(peers._prompts(1, peers.PROMPT), 8)
    hwm = next(int(ln.split()[1]) for ln in Path("/proc/self/status").read_text().splitlines()
               if ln.startswith("VmHWM"))
    eng.close()
    print(json.dumps({"rss_mib": hwm / 1024}))


def _pmx_rss(model: Path, a: dict) -> float:
    out = peers._run([sys.executable, peers.SELF.parent / "gguf_peers.py", "pmx_rss", model, "--threads", a["threads"]],
                     "pmx rss", cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])["rss_mib"]


def _pair_up(name: str, pmx_rate, llama_rate, pairs: int) -> dict:
    """Alternates the two systems' slices `pairs` times (who goes first alternating); medians and per-pair ratios."""
    ours, theirs = [], []
    pmx_rate()  # warm-up
    for i in range(pairs):
        x, y = (pmx_rate(), llama_rate()) if i % 2 == 0 else reversed((llama_rate(), pmx_rate()))
        ours.append(x)
        theirs.append(y)
        print(f"  {name} pair {i + 1}/{pairs}: pmx-runner {x:.1f}, llama.cpp {y:.1f} tok/s, ratio {x / y:.3f}",
              file=sys.stderr, flush=True)
    ratios = [x / y for x, y in zip(ours, theirs)]
    return {"pmx": ours, "llama.cpp": theirs, "ratios": ratios, "pmx_median": statistics.median(ours),
            "llama_median": statistics.median(theirs), "ratio_median": statistics.median(ratios)}


def _meta(a: dict, command: str, **extra) -> dict:
    return {"command": command, "date": datetime.date.today().isoformat(), "cpu": peers._cpu_name(),
            "threads": a["threads"], "load_avg_start": os.getloadavg(), "versions": peers._versions(a),
            "note": "the 2-core box was shared with other jobs", **extra}


def _save(report: dict, json_path: str | None, command: str) -> None:
    report["load_avg_end"] = os.getloadavg()
    path = Path(json_path or REPO / "benchmarks" / "results" / f"gguf_peers_{command}-{report['date']}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")


def speed(models: str = "smollm2,q8_0,q4_0", points: str = ",".join(POINTS), pairs: int = 6, tokens: int = 64,
          threads: int = 2, json_path: str | None = None, workdir: str = str(WORK), llama_cpp: str | None = None
          ) -> None:
    """pmx-runner TP=1 on each GGUF's conversion and llama.cpp on the GGUF, paired by point (see the module doc)."""
    import torch
    a = _args(threads, workdir, llama_cpp)
    torch.set_num_threads(threads)
    report = _meta(a, "speed", pairs=pairs, tokens=tokens, models={})
    for name in peers._csv(models):
        gguf = gguf_of(name, a)
        pmx = pmx_of(gguf, a)
        entry = report["models"][name] = {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size,
                                          "pmx_bytes": sum(f.stat().st_size for f in pmx.glob("*.safetensors")),
                                          "pmx_rss_mib": _pmx_rss(pmx, a), "llama_rss_mib": _llama_rss(a, gguf)}
        eng = peers.open_engine(str(pmx))
        for point in peers._csv(points):
            entry[point] = _pair_up(f"{name} {point}", lambda: peers._point_rate(eng.generate, point, tokens),
                                    lambda: _llama_rate(a, gguf, point, tokens), pairs)
        eng.close()
        _save(report, json_path, "speed")
    print(f"\n{threads} threads, {pairs} pairs a point (the box was shared); tokens/s medians, pmx / llama.cpp ratio:")
    print("| model | point | pmx-runner | llama.cpp | ratio (median of pairs) |\n|---|---|---|---|---|")
    for name, entry in report["models"].items():
        for point in peers._csv(points):
            e = entry[point]
            print(f"| {name} | {point} | {e['pmx_median']:.1f} | {e['llama_median']:.1f} | {e['ratio_median']:.3f} |")
    for name, entry in report["models"].items():
        print(f"{name}: GGUF {entry['gguf_bytes'] / 2**20:.1f} MiB, PMX {entry['pmx_bytes'] / 2**20:.1f} MiB; peak RSS "
              f"pmx-runner {entry['pmx_rss_mib']:.0f} MiB, llama.cpp {entry['llama_rss_mib']:.0f} MiB")


def _llama_perplexity(a: dict, gguf: Path, text: Path, ctx: int) -> dict:
    out = peers._run([_bindir(a) / "llama-perplexity", "-m", gguf, "-f", text, "-c", str(ctx), "-b", str(ctx), "-t",
                      str(a["threads"])], "llama-perplexity")
    log = out.stdout + out.stderr
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", log)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    if m is None or chunks is None:
        raise peers.Skip(f"llama-perplexity printed no estimate: {log.strip().splitlines()[-3:]}")
    return {"ppl": float(m.group(1)), "stderr": float(m.group(2)), "chunks": int(chunks.group(1)),
            "log_tail": log.strip().splitlines()[-4:]}


def perplexity(model: str = "smollm2", text: str = str(REPO / "tests" / "data" / "story.txt"), ctx: int = 128,
               threads: int = 2, json_path: str | None = None, workdir: str = str(WORK),
               llama_cpp: str | None = None) -> None:
    """llama-perplexity against `runner perplexity` on the same GGUF and text (see the module doc)."""
    import torch
    from runner.engine.perplexity import perplexity as runner_perplexity
    a = _args(threads, workdir, llama_cpp)
    torch.set_num_threads(threads)
    gguf = gguf_of(model, a)
    pmx = pmx_of(gguf, a)
    report = _meta(a, "perplexity", model=model, text=text, ctx=ctx)
    report["llama.cpp"] = lcpp = _llama_perplexity(a, gguf, Path(text), ctx)
    ours = runner_perplexity(str(pmx), text, window=ctx, stride=ctx // 2)
    report["pmx-runner"] = {k: ours[k] for k in ("perplexity", "tokens")}
    same = runner_perplexity(str(pmx), text, window=ctx, scoring="chunks")
    report["pmx-runner, llama.cpp's chunks"] = {k: same[k] for k in ("perplexity", "tokens")}
    report["ratio"] = ours["perplexity"] / lcpp["ppl"]
    report["ratio, llama.cpp's chunks"] = same["perplexity"] / lcpp["ppl"]
    print(f"{model}, {text}, ctx {ctx}: llama-perplexity {lcpp['ppl']:.4f} +/- {lcpp['stderr']:.4f} "
          f"({lcpp['chunks']} chunks); runner perplexity --scoring chunks {same['perplexity']:.4f} over "
          f"{same['tokens']} tokens (ratio {same['perplexity'] / lcpp['ppl']:.4f}); runner perplexity (sliding "
          f"windows, stride {ctx // 2}) {ours['perplexity']:.4f} over {ours['tokens']} tokens (ratio "
          f"{report['ratio']:.4f})")
    _save(report, json_path, "perplexity")


def q4_1(pairs: int = 6, tokens: int = 64, threads: int = 2, text: str = str(REPO / "tests" / "data" / "story.txt"),
         json_path: str | None = None, workdir: str = str(WORK), llama_cpp: str | None = None) -> None:
    """SmolLM2's Q4_1 linears kept exact (int4 + offsets) or dequantised to float32, each beside llama.cpp."""
    import torch
    from runner.engine.perplexity import perplexity as runner_perplexity
    a = _args(threads, workdir, llama_cpp)
    torch.set_num_threads(threads)
    gguf = gguf_of("smollm2", a)
    report = _meta(a, "q4_1", pairs=pairs, tokens=tokens, llama_rss_mib=_llama_rss(a, gguf), variants={})
    for tag, exact in (("exact", ("Q8_0", "Q4_0", "Q4_1")), ("dequantised", ("Q8_0",))):
        pmx = pmx_of(gguf, a, exact)
        v = report["variants"][tag] = {"pmx_bytes": sum(f.stat().st_size for f in pmx.glob("*.safetensors")),
                                       "pmx_rss_mib": _pmx_rss(pmx, a)}
        v["perplexity"] = runner_perplexity(str(pmx), text, window=128, stride=64)["perplexity"]
        eng = peers.open_engine(str(pmx))
        for point in ("decode_b1", "prefill_512"):
            v[point] = _pair_up(f"{tag} {point}", lambda: peers._point_rate(eng.generate, point, tokens),
                                lambda: _llama_rate(a, gguf, point, tokens), pairs)
        eng.close()
        _save(report, json_path, "q4_1")
    print(f"\nSmolLM2 Q4_1, {threads} threads, {pairs} pairs (the box was shared); llama.cpp peak RSS "
          f"{report['llama_rss_mib']:.0f} MiB, GGUF {gguf.stat().st_size / 2**20:.1f} MiB")
    print("| Q4_1 linears | decode b1 tok/s (pmx / llama.cpp) | prefill 512 tok/s (pmx / llama.cpp) | PMX MiB | "
          "peak RSS MiB | perplexity |\n|---|---|---|---|---|---|")
    for tag, v in report["variants"].items():
        d, p = v["decode_b1"], v["prefill_512"]
        print(f"| {tag} | {d['pmx_median']:.1f} / {d['llama_median']:.1f} ({d['ratio_median']:.3f}) | "
              f"{p['pmx_median']:.1f} / {p['llama_median']:.1f} ({p['ratio_median']:.3f}) | "
              f"{v['pmx_bytes'] / 2**20:.1f} | {v['pmx_rss_mib']:.0f} | {v['perplexity']:.4f} |")


def layout(threads: int = 2, workdir: str = str(WORK), llama_cpp: str | None = None) -> None:
    """The gqa shape from its HF checkpoint and from llama.cpp's F32 GGUF of it: the same greedy tokens and logits."""
    import torch
    from runner.pmx.convert import convert
    a = _args(threads, workdir, llama_cpp)
    torch.set_num_threads(threads)
    f32 = _gqa_f32(a)
    hf_pmx = a["work"] / "pmx-gqa-hf"
    if not (hf_pmx / "pmx_params.json").exists():
        convert(str(a["work"] / "gqa" / "hf"), str(hf_pmx), overwrite=True, progress=False)
    prompts = peers._prompts(2, 16)
    outs = {}
    for tag, model in (("hf", hf_pmx), ("gguf", pmx_of(f32, a))):
        eng = peers.open_engine(str(model))
        outs[tag] = eng.generate(prompts, 16)
        eng.close()
    same = outs["hf"] == outs["gguf"]
    print(f"greedy tokens of 2 prompts x 16: {'equal' if same else 'DIFFERENT'} from the HF checkpoint and from "
          f"llama.cpp's GGUF of it")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    fire.Fire({"speed": speed, "perplexity": perplexity, "q4_1": q4_1, "layout": layout, "pmx_rss": pmx_rss})
