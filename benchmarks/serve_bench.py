#!/usr/bin/env python3
"""Serving benchmark (after vLLM's benchmark_serving): streamed /v1/completions requests sent all at once
or at a Poisson rate to an OpenAI-compatible server; request and token throughput, time to first token
(TTFT) and inter-token latency (ITL) p50 / p99.

    python benchmarks/serve_bench.py [--model ../shared/models/stories260k] [--num_requests 64]
        [--request_rates inf,8] [--input_len 64] [--output_len 128] [--systems pmx1,pmx2,llama.cpp]
        [--threads 1] [--results benchmarks/RESULTS.md]

Systems: `pmx1` (`python -m runner serve`, one process), `pmx2` (the same under `mpirun -np 2`), and
`llama.cpp` (its `llama-server` on the same weights, an f32 GGUF made by llama.cpp's own
convert_hf_to_gguf.py). llama-server is taken from --llama_server, or from
~/.cache/pmx-runner/llama.cpp/build-server, built there from the llama.cpp source kept under
~/.cache/pmx-runner/llama.cpp (the llama-cpp-python sdist) when cmake is present (minutes on 2 cores);
otherwise it is skipped with a message. Every request greedy-decodes exactly --output_len tokens
(`ignore_eos`), prompts are story sentences of about --input_len tokens, all on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import fire
import httpx

from runner.args import items

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "pmx-runner"
LLAMA_DIR = CACHE / "llama.cpp"
SENTENCES = ("Once upon a time, there was a little girl named Lily.", "She loved to play outside in the park.",
             "One day, she saw a big, red ball.", "Tom and his dog ran to the big tree.",
             "The sun was warm and the birds sang.", "Mom made a cake for the party.",
             "They were happy and played all day.", "The cat did not like the rain.")


class Skip(Exception):
    """A system that cannot run here (said why)."""


# -- servers -----------------------------------------------------------------------------------------
class Server:
    """A server process (its own session) and its base URL; stop() sends SIGTERM and waits."""

    def __init__(self, name: str, cmd: list, log: Path, env: dict, url_of):
        self.name, self.log = name, log
        self.proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.DEVNULL, stderr=open(log, "w"),
                                     start_new_session=True, env={**os.environ, **env}, cwd=ROOT)
        deadline = time.monotonic() + 600
        self.url = None
        while self.url is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise Skip(f"{name} did not start (see {log})")
            time.sleep(0.2)
            self.url = url_of(log.read_text(errors="replace"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _pmx_url(text: str):
    m = re.search(r"serving .* at (http://\S+) \(", text)
    return m.group(1) if m else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_pmx(work: Path, ranks: int, args: dict) -> Server:
    from runner.pmx.convert import convert, reshard
    pmx = work / f"pmx{ranks}"
    if not (pmx / "pmx_params.json").exists():
        base = work / "pmx1"
        if not (base / "pmx_params.json").exists():
            convert(str(args["model"]), str(base), progress=False)
        if ranks > 1:
            reshard(str(base), str(pmx), ranks, progress=False)
    cmd = [sys.executable, "-m", "runner", "serve", "--ckpt_dir", pmx, "--port", 0, "--served_model_name", "model",
           "--max_batch", args["max_batch"], "--max_num_batched_tokens", max(512, args["max_batch"])]
    threads = max(1, args["threads"] // ranks)
    if ranks > 1:
        cmd = [ROOT / "scripts" / "mpirun.sh", "-np", ranks, *cmd]
    return Server(f"pmx{ranks}", cmd, work / f"pmx{ranks}.log", {"OMP_NUM_THREADS": str(threads)}, _pmx_url)


def _llama_source() -> Path:
    found = sorted(LLAMA_DIR.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not found:
        raise Skip(f"no llama.cpp source under {LLAMA_DIR} (the llama-cpp-python sdist unpacked there)")
    return found[-1].parent


def _llama_server(given) -> Path:
    if given:
        if not Path(given).is_file():
            raise Skip(f"--llama_server {given} not found")
        return Path(given)
    exe = LLAMA_DIR / "build-server" / "bin" / "llama-server"
    if exe.is_file():
        return exe
    if shutil.which("llama-server"):
        return Path(shutil.which("llama-server"))
    src = _llama_source()
    if not shutil.which("cmake"):
        raise Skip("llama-server is not built and cmake is missing (apt-get install cmake g++)")
    log = LLAMA_DIR / "server-build.log"
    print(f"building llama-server once into {exe.parent.parent} (minutes on 2 cores; log {log})", file=sys.stderr)
    with open(log, "a") as out:
        for cmd in (["cmake", "-S", src, "-B", LLAMA_DIR / "build-server", "-DCMAKE_BUILD_TYPE=Release",
                     "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                     "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                     "-DLLAMA_BUILD_EXAMPLES=OFF"],
                    ["cmake", "--build", LLAMA_DIR / "build-server", "--target", "llama-server", "-j2"]):
            if subprocess.run([str(c) for c in cmd], stdout=out, stderr=out).returncode:
                raise Skip(f"the llama-server build failed (see {log})")
    return exe


def start_llama(work: Path, args: dict) -> Server:
    exe = _llama_server(args["llama_server"])
    gguf = work / "model-f32.gguf"
    if not gguf.exists():
        src = _llama_source()
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}  # the converter's own package, beside it
        res = subprocess.run([sys.executable, src / "convert_hf_to_gguf.py", args["model"], "--outtype", "f32",
                              "--outfile", gguf.with_suffix(".tmp")], capture_output=True, text=True, env=env)
        if res.returncode:
            raise Skip(f"convert_hf_to_gguf.py failed: {res.stderr.strip().splitlines()[-1:]}")
        gguf.with_suffix(".tmp").rename(gguf)
    port = _free_port()
    slots = args["max_batch"]
    ctx = slots * (args["input_len"] * 2 + args["output_len"] + 16)
    cmd = [exe, "-m", gguf, "--host", "127.0.0.1", "--port", port, "-np", slots, "-c", ctx, "-t", args["threads"],
           "--alias", "model", "--no-warmup"]
    url = f"http://127.0.0.1:{port}"

    def ready(_):
        try:
            return url if httpx.get(f"{url}/health", timeout=1).status_code == 200 else None
        except httpx.HTTPError:
            return None
    return Server("llama.cpp", cmd, work / "llama-server.log", {}, ready)


# -- the client ----------------------------------------------------------------------------------------
def prompts(n: int, input_len: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.randint(input_len // 2, input_len * 3 // 2) * 3 // 4  # ~0.75 words per token
        text = []
        while len(" ".join(text).split()) < words:
            text.append(rng.choice(SENTENCES))
        out.append(" ".join(" ".join(text).split()[:words]))
    return out


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, output_len: int) -> dict:
    body = {"model": "model", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    times = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "error": f"HTTP {r.status_code}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if any(c.get("text") for c in chunk.get("choices", [])):
                times.append(time.perf_counter())
    if not times:
        return {"ok": False, "error": "no tokens"}
    return {"ok": True, "ttft": times[0] - t0, "itl": [b - a for a, b in zip(times, times[1:])],
            "tokens": len(times), "e2e": times[-1] - t0}


async def run_load(url: str, texts: list, output_len: int, rate: float, seed: int) -> dict:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(texts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one_request(client, url, texts[0], 4)  # warm-up
        t0 = time.perf_counter()
        tasks = []
        for text in texts:
            tasks.append(asyncio.ensure_future(one_request(client, url, text, output_len)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    itl = [x for r in ok for x in r["itl"]]

    def pct(xs, q):
        return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] * 1000 if len(xs) > 1 else float("nan")
    return {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
            "req_per_s": len(ok) / duration, "out_tok_per_s": sum(r["tokens"] for r in ok) / duration,
            "ttft_p50_ms": pct([r["ttft"] for r in ok], 50), "ttft_p99_ms": pct([r["ttft"] for r in ok], 99),
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
            "e2e_p50_s": statistics.median([r["e2e"] for r in ok]) if ok else float("nan")}


# -- report --------------------------------------------------------------------------------------------
def table(rows: list) -> str:
    head = ("| system | rate (req/s) | done | time (s) | req/s | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | "
            "ITL p50 (ms) | ITL p99 (ms) |\n|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['system']} | {r['rate']} | {r['completed']}/{r['completed'] + r['failed']} | {r['duration_s']:.1f} | "
        f"{r['req_per_s']:.2f} | {r['out_tok_per_s']:.0f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
        f"{r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} |\n" for r in rows)


def write_results(path: Path, section: str) -> None:
    """Replaces (or appends) the '## Serving' section of RESULTS.md."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    start = text.find("\n## Serving")
    if start >= 0:
        nxt = text.find("\n## ", start + 1)
        text = text[:start] + (text[nxt:] if nxt >= 0 else "")
    path.write_text(text.rstrip("\n") + "\n\n" + section)


def main(model: str = str(ROOT.parent / "shared" / "models" / "stories260k"), num_requests: int = 64,
         request_rates: str = "inf,8", input_len: int = 64, output_len: int = 128, max_batch: int = 32,
         systems: str = "pmx1,pmx2,llama.cpp", threads: int = 1, llama_server: str = "", seed: int = 0,
         workdir: str = str(CACHE / "serve-bench"), results: str = "", json_path: str = "") -> None:
    """Runs the benchmark; prints a markdown table (and writes it into --results when given)."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    args = dict(model=Path(model), max_batch=max_batch, threads=threads, llama_server=llama_server,
                input_len=input_len, output_len=output_len)
    texts = prompts(num_requests, input_len, seed)
    rates = [float(r) for r in items(request_rates)]
    rows, skipped = [], []
    for system in items(systems):
        try:
            srv = start_llama(work, args) if system == "llama.cpp" else start_pmx(work, int(system[3:]), args)
        except Skip as e:
            print(f"skipping {system}: {e}", file=sys.stderr)
            skipped.append(f"{system}: {e}")
            continue
        try:
            for rate in rates:
                print(f"{system}: {num_requests} requests at {rate} req/s ...", file=sys.stderr, flush=True)
                r = asyncio.run(run_load(srv.url, texts, output_len, rate, seed))
                rows.append({"system": system, "rate": "all at once" if rate == float("inf") else rate, **r})
        finally:
            srv.stop()
    out = table(rows)
    print(out)
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    if results:
        import torch
        section = (f"## Serving (`benchmarks/serve_bench.py`)\n\nMachine: the project's CPU box (2 cores, 24 GiB, "
                   f"no GPU, shared with other jobs: timings are noisy), Python {sys.version.split()[0]}, torch "
                   f"{torch.__version__}, {time.strftime('%Y-%m-%d')}. Model: {Path(model).name} (fp32). "
                   f"{num_requests} streamed /v1/completions requests of about {input_len} prompt tokens, "
                   f"{output_len} greedy output tokens each (ignore_eos), sent all at once or at a Poisson rate; "
                   f"max batch / parallel slots {max_batch}; {threads} thread(s) per system (pmx2: "
                   f"{max(1, threads // 2)} per rank). TTFT includes queueing. With a model this small the numbers "
                   f"measure each server's per-step overhead and its batching, not matmul speed.\n\n{out}")
        if skipped:
            section += "\nSkipped: " + "; ".join(skipped) + "\n"
        write_results(Path(results), section)


if __name__ == "__main__":
    fire.Fire(main)
