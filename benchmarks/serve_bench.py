#!/usr/bin/env python3
"""Serving benchmark: pmx-runner's OpenAI server (`python -m runner serve`) against llama.cpp's `llama-server` on the
same weights, streamed /v1/completions on 127.0.0.1, every request greedy with a fixed output length (ignore_eos).

    python benchmarks/serve_bench.py [all] [--model base] [--rounds 3] [--json_path out/serve_bench.json]
    python benchmarks/serve_bench.py agree  [--model base] [--agree_tokens 64]
    python benchmarks/serve_bench.py sweep  [--concurrency 1,4,16,64] [--systems pmx1,llama.cpp[,pmx2][,base1]]
                                            [--rounds 3] [--input_len 128] [--output_len 128] [--baseline DIR]
    python benchmarks/serve_bench.py prefix [--prefix_len 1500] [--questions 8] [--prefix_output_len 32]
    python benchmarks/serve_bench.py spec   [--spec_output_len 200] [--rounds 3]
    python benchmarks/serve_bench.py spec --model ../shared/models/tinystories-656k     (real weights; pmx only)
  every command also takes --threads 2, --llama_cpp DIR, --workdir DIR, --seed 0

Parts (`all` runs them in this order and prints every table):
  agree   greedy tokens of pmx-runner (its engine, the `LLM` API) and of llama-server (/completion, return_tokens)
          on one short prompt: how many agree, with llama-server's default f16 KV cache and with an f32 one.
  sweep   closed loop: C requests in flight at all times (a new one sent as one finishes), max(8, 2C) requests a
          point, for C in --concurrency, prompts of their own for every round and level (the same for every system:
          no server sees a prompt twice); output tokens/s (all output tokens / wall time), time to first token and
          inter-token latency (the gaps between a stream's token chunks) p50 / p99.
  prefix  one --prefix_len-token system prompt shared by --questions short distinct questions, one request at a
          time: TTFT of the first (cold) and of the later ones on pmx-runner with prefix caching (the default of
          `serve`) and with `--enable_prefix_caching false`, outputs checked identical (token by token), and on
          llama-server (slots keep their prompt's KV, `cache_prompt` on: its own prefix reuse).
  spec    the repetitive workload at batch 1 (an editing request: the prompt holds a passage and ends with its
          opening, the continuation repeats it): output tokens/s with `--speculative ngram --num_speculative_tokens
          4 --prompt_lookup_max 4 --prompt_lookup_min 1` and without, outputs checked token for token, the
          acceptance rate from /metrics (pmx_spec_decode_accepted_tokens_total / ..._draft_tokens_total).

Systems: pmx1 (one process, THREADS threads), pmx2 (scripts/mpirun.sh -np 2, THREADS/2 threads a rank), base1 (pmx1
from the checkout --baseline DIR, e.g. a worktree of main, to measure a change against), llama.cpp
(llama-server -t THREADS -tb THREADS, -np slots >= the concurrency, one unified KV pool -kvu, --cont-batching,
--cache-prompt; its default f16 KV cache) and hf (sweep only: transformers' generate in this process, one static
batch of C prompts per level: HFStatic). `--device cuda` serves pmx on the GPU (and runs hf there). The pmx servers
run this checkout's runner (PYTHONPATH). In every part the systems take turns (A, B, A, B, ... rotating who goes
first), all of them loaded meanwhile; the tables give medians over --rounds and their range, the JSON every raw
figure, the load average and the cores other processes kept busy during each measurement (the box is shared:
timings are noisy).

The model: --model names a shape of benchmarks/cpu_peers.py (base: 134M parameters, random weights, 2048
positions; gqa), whose checkpoint, PMX conversion (runner.pmx.convert, as `python -m runner convert`) and F32 GGUF
(llama.cpp's convert_hf_to_gguf.py) are shared with that benchmark under ~/.cache/pmx-runner/peers/SHAPE, a PMX
directory (served as it is, by pmx1 / pmx2 and hf; with --random_weights true its pmx_params.json and tokenizer are
all it needs: benchmarks/gpu_session.py serve_model writes one), or an HF
Llama directory (pmx only, or with llama-server on its GGUF). The prompts are token ids (BOS, then ids drawn from
[3, 400)), sent as such to both servers: the GGUF carries cpu_peers' stand-in sentencepiece tokenizer, so the two
servers' texts differ while their tokens are the same model's. llama-server comes from cpu_peers' llama.cpp build
(~/.cache/pmx-runner/llama.cpp/build, made once from the llama-cpp-python sdist: about 15 minutes on 2 cores) or
--llama_cpp DIR (a directory holding llama-server, or its bin/); without cmake, or if the build fails, llama.cpp is
skipped with the reason and the pmx systems still run. Every server runs in its own process group, which is ended
(SIGTERM, then SIGKILL) when the benchmark exits, fails or is interrupted.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import fire
import httpx

from runner.args import parse_bool

from cpu_peers import SHAPES, Skip, _cpu_name, _cpu_seconds, _llama_cpp_model, _pmx_model, _versions

REPO = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "pmx-runner"
SPEC_FLAGS = ("--speculative", "ngram", "--num_speculative_tokens", "4", "--prompt_lookup_max", "4",
              "--prompt_lookup_min", "1")
ID_RANGE = (3, 400)  # prompt token ids: ordinary pieces of both tokenizers


# -- servers -------------------------------------------------------------------------------------------------------
class Server:
    """A server in its own process group (its log in WORK/NAME.log); ready() waits for it, stop() ends the group."""

    def __init__(self, name: str, cmd: list, env: dict, log: Path, url_of, cwd: Path = REPO):
        self.name, self.log, self.url_of, self.url = name, log, url_of, None
        self._out = open(log, "w")
        self.proc = subprocess.Popen([str(c) for c in cmd], stdout=self._out, stderr=subprocess.STDOUT, cwd=cwd,
                                     start_new_session=True, env={**os.environ, **env})

    def ready(self, timeout: float = 900) -> "Server":
        deadline = time.monotonic() + timeout
        while self.url is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-1:]
                self.stop()
                raise Skip(f"{self.name} did not start ({tail[0] if tail else 'no output'}; see {self.log})")
            time.sleep(0.2)
            self.url = self.url_of(self.log.read_text(errors="replace"))
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break
        try:  # what the leader left behind (mpirun's ranks)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._out.close()


@contextmanager
def servers(specs: dict, setup: dict):
    """{name: (kind, extra flags)} started together, waited for, and stopped (all of them, whatever happens);
    yields {name: Server} of those that started, and records why the others did not in setup["skipped"]."""
    started, up = [], {}

    def on_term(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        for name, (kind, extra) in specs.items():
            try:
                started.append(start_llama(name, setup, extra) if kind == "llama.cpp" else
                               start_pmx(name, int(kind[-1]), setup, extra))
            except Skip as e:
                setup["skipped"][name] = str(e)
                print(f"skipping {name}: {e}", file=sys.stderr, flush=True)
        for srv in started:
            try:
                up[srv.name] = srv.ready()
            except Skip as e:
                setup["skipped"][srv.name] = str(e)
                print(f"skipping {srv.name}: {e}", file=sys.stderr, flush=True)
        yield up
    finally:
        for srv in started:
            srv.stop()
        signal.signal(signal.SIGTERM, old)


def _pmx_url(text: str):
    m = re.search(r"serving .* at (http://\S+) \(", text)
    return m.group(1) if m else None


def start_pmx(name: str, ranks: int, setup: dict, extra: tuple) -> Server:
    """pmx1 / pmx2: this checkout's server on 1 / 2 ranks; base1: --baseline's checkout on 1 rank (its own .venv's
    Python where it has one)."""
    model = setup.get("pmx_dir") or _pmx_model(ranks, setup["a"])
    root = setup["baseline"] if name == "base1" else REPO
    python = root / ".venv" / "bin" / "python" if name == "base1" and (root / ".venv" / "bin" / "python").exists() \
        else Path(sys.executable)
    cmd = [python, "-m", "runner", "serve", "--ckpt_dir", model, "--port", 0, "--served_model_name", "model",
           "--device", setup.get("device", "cpu"), *(("--random_weights",) if setup.get("random_weights") else ()),
           *extra, *setup.get("pmx_extra", ())]
    if ranks > 1:
        cmd = [root / "scripts" / "mpirun.sh", "-np", ranks, *cmd]
    env = {"OMP_NUM_THREADS": str(max(1, setup["threads"] // ranks)),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    print(f"starting {name}: {' '.join(map(str, cmd))} (OMP_NUM_THREADS={env['OMP_NUM_THREADS']})", file=sys.stderr)
    return Server(name, cmd, env, setup["work"] / f"{name}.log", _pmx_url, cwd=root)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama(name: str, setup: dict, extra: tuple) -> Server:
    if "llama" not in setup:
        try:
            setup["llama"] = _llama_cpp_model(setup["a"], tools=("llama-server",))
        except Skip as e:
            setup["llama"] = e
    if isinstance(setup["llama"], Skip):
        raise setup["llama"]
    bindir, gguf = setup["llama"]
    port, t = _free_port(), setup["threads"]
    cmd = [bindir / "llama-server", "-m", gguf, "--host", "127.0.0.1", "--port", port, "-t", t, "-tb", t,
           "--alias", "model", *extra]
    print(f"starting {name}: {' '.join(map(str, cmd))}", file=sys.stderr)
    url = f"http://127.0.0.1:{port}"

    def ready(_):
        try:
            return url if httpx.get(f"{url}/health", timeout=1).status_code == 200 else None
        except httpx.HTTPError:
            return None
    return Server(name, cmd, {}, setup["work"] / f"{name}.log", ready)


def llama_flags(slots: int, ctx: int) -> tuple:
    """llama-server's serving flags: `slots` parallel slots sharing one KV pool of `ctx` tokens (each may use all of
    it), continuous batching, the prompt cache on (its defaults, said out loud)."""
    return ("-np", slots, "-c", ctx, "-kvu", "--cont-batching", "--cache-prompt")


def pmx_flags(max_batch: int, kv_tokens: int, *extra) -> tuple:
    return ("--max_batch", max_batch, "--kv_cache_tokens", kv_tokens, *extra)


def metrics(url: str) -> dict:
    """A pmx server's counters from /metrics (the pmx_ prefix dropped; labelled series summed)."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        m = re.match(r"pmx_(\w+?)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0) + float(m.group(2))
    return out


# -- the client ----------------------------------------------------------------------------------------------------
def token_prompt(rng: random.Random, n: int, bos: bool = True) -> list[int]:
    return ([1] if bos else []) + [rng.randrange(*ID_RANGE) for _ in range(n)]


async def stream_request(client: httpx.AsyncClient, url: str, prompt, output_len: int) -> dict:
    """One streamed greedy completion: the arrival time of each chunk carrying tokens (a chunk with choices and no
    usage: llama-server's last chunk carries only the usage and finish reason), the text, the usage."""
    body = {"model": "model", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, text, usage = [], [], None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if chunk.get("choices") and not chunk.get("usage"):
                times.append(time.perf_counter())
                text.append(chunk["choices"][0].get("text") or "")
    if not times:
        raise RuntimeError(f"{url}: no tokens streamed")
    tokens = usage["completion_tokens"] if usage else len(times)
    return {"ttft": times[0] - t0, "itl": [b - a for a, b in zip(times, times[1:])], "tokens": tokens,
            "chunks": len(times), "e2e": times[-1] - t0, "text": "".join(text)}


async def closed_loop(url: str, prompts: list, output_len: int, concurrency: int) -> dict:
    """`concurrency` workers, each sending its next request as soon as its last one finished."""
    todo, results = list(enumerate(prompts)), [None] * len(prompts)
    # a connection per request: llama-server (cpp-httplib) closes a kept-alive connection after a few requests, and a
    # request sent on it as it closes fails; a loopback connect costs both servers the same ~0.1 ms
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=1800, limits=limits) as client:
        async def worker():
            while todo:
                i, p = todo.pop(0)
                results[i] = await stream_request(client, url, p, output_len)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - t0
    return {"duration": duration, "requests": results}


def pct(xs: list, q: int) -> float:
    xs = list(xs)
    if len(xs) < 2:
        return xs[0] * 1e3 if xs else float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] * 1e3


def summarize(run: dict) -> dict:
    reqs = run["requests"]
    itl = [x for r in reqs for x in r["itl"]]
    return {"requests": len(reqs), "duration_s": run["duration"],
            "out_tok_s": sum(r["tokens"] for r in reqs) / run["duration"],
            "ttft_p50_ms": pct([r["ttft"] for r in reqs], 50), "ttft_p99_ms": pct([r["ttft"] for r in reqs], 99),
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
            "tokens_per_chunk": sum(r["tokens"] for r in reqs) / sum(r["chunks"] for r in reqs)}


def measured(srv: Server, fn):
    """fn()'s result with the load around it: the 1-minute load average before and the cores everything but the
    server (its process group) and this client kept busy meanwhile (CPU seconds a second, from /proc)."""
    load = os.getloadavg()[0]
    t0, all0, own0, me0 = time.perf_counter(), _cpu_seconds(), _cpu_seconds(srv.proc.pid), _cpu_seconds(os.getpid())
    res = fn()
    dt = time.perf_counter() - t0
    other = (_cpu_seconds() - all0) - (_cpu_seconds(srv.proc.pid) - own0) - (_cpu_seconds(os.getpid()) - me0)
    return res, {"loadavg_1m": load, "other_cores": max(0.0, other) / dt}


def rotated(names: list, k: int) -> list:
    k %= max(len(names), 1)
    return names[k:] + names[:k]


def spread(xs: list, fmt: str = "{:.0f}") -> str:
    """median (min-max)"""
    if not xs:
        return "-"
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


# -- set-up --------------------------------------------------------------------------------------------------------
def make_setup(model: str, threads: int, workdir: str, llama_cpp: str | None) -> dict:
    from runner.pmx.random_model import make_random_model
    if model in SHAPES:
        work = Path(workdir).expanduser() / "peers" / model
        hf = work / "hf"
        if not (hf / "config.json").exists():
            make_random_model(str(hf), **SHAPES[model], overwrite=True)
    elif (Path(model) / "config.json").is_file():
        hf = Path(model).resolve()
        work = Path(workdir).expanduser() / "serve-bench" / hf.name
    elif (Path(model) / "pmx_params.json").is_file():  # served as it is (pmx systems and hf only)
        pmx = Path(model).resolve()
        work = Path(workdir).expanduser() / "serve-bench" / pmx.name
        work.mkdir(parents=True, exist_ok=True)
        p = json.loads((pmx / "pmx_params.json").read_text())
        a = dict(work=work, hf=None, threads=threads, llama_cpp=None)
        return {"a": a, "work": work, "threads": threads, "skipped": {}, "model": model, "pmx_dir": pmx,
                "max_positions": p["max_position_embeddings"], "vocab_size": p["vocab_size"]}
    else:
        raise SystemExit(f"--model {model}: expected a shape of benchmarks/cpu_peers.py ({', '.join(SHAPES)}), an "
                         f"HF checkpoint directory (holding config.json) or a PMX directory (pmx_params.json)")
    work.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((hf / "config.json").read_text())
    a = dict(work=work, hf=hf, threads=threads, llama_cpp=llama_cpp or os.environ.get("PMX_LLAMA_CPP"))
    return {"a": a, "work": work, "threads": threads, "skipped": {}, "model": model,
            "max_positions": cfg.get("max_position_embeddings"), "vocab_size": cfg.get("vocab_size")}


def env_report(setup: dict) -> dict:
    import torch
    v = _versions({})
    bin_ = setup.get("llama")
    return {"cpu": f"{_cpu_name()}, {os.cpu_count()} cores", "python": v["python"], "torch": torch.__version__,
            "pmx-runner": v["pmx-runner"], "llama.cpp": v["llama.cpp"],
            "llama-server": None if not isinstance(bin_, tuple) else str(bin_[0] / "llama-server"),
            "model": setup["model"], "threads": setup["threads"], "date": time.strftime("%Y-%m-%d %H:%M")}


# -- the parts -----------------------------------------------------------------------------------------------------
def part_agree(setup: dict, tokens: int, seed: int) -> dict:
    """Greedy tokens of pmx-runner's engine and of llama-server (f16 and f32 KV cache) on one short prompt."""
    import torch
    from runner import LLM, SamplingParams
    prompt = token_prompt(random.Random(seed), 16)
    torch.set_num_threads(setup["threads"])
    with LLM(str(_pmx_model(1, setup["a"])), max_batch=1, kv_cache_tokens=512) as llm:
        ours = llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))[0]
        ours = ours.outputs[0].token_ids
    res = {"prompt": prompt, "pmx": ours, "llama.cpp": {}}
    specs = {f"llama.cpp-kv-{kv}": ("llama.cpp", ("-np", 1, "-c", 512, "-ctk", kv, "-ctv", kv))
             for kv in ("f16", "f32")}
    with servers(specs, setup) as up:
        for name, srv in up.items():
            body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "ignore_eos": True,
                    "return_tokens": True, "cache_prompt": False}
            theirs = httpx.post(f"{srv.url}/completion", json=body, timeout=600).json()["tokens"]
            same = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))
            res["llama.cpp"][name] = {"tokens": theirs, "agree_first": same,
                                      "agree_all": sum(x == y for x, y in zip(ours, theirs))}
            print(f"agree: pmx and {name}: the first {same} of {tokens} greedy tokens agree "
                  f"({res['llama.cpp'][name]['agree_all']} positions in all)", file=sys.stderr, flush=True)
    return res


def part_sweep(setup: dict, systems: list, levels: list, rounds: int, input_len: int, output_len: int,
               seed: int, save=lambda runs: None) -> dict:
    """The closed-loop sweep; save(runs) after every measurement (a long sweep cut short keeps what it has)."""
    top = max(levels)
    kv = top * (input_len + output_len + 16) + 2048
    specs = {s: ("llama.cpp", llama_flags(top, kv)) if s == "llama.cpp" else (s, pmx_flags(top, kv))
             for s in systems if s != "hf"}
    rng = random.Random(seed)

    def fresh(n: int) -> list:
        return [token_prompt(rng, rng.randint(input_len * 3 // 4, input_len * 5 // 4)) for _ in range(n)]
    # prompts of their own for every round and level (each system gets the same ones): a server never sees a prompt
    # twice, so neither llama-server's slot prompt cache nor prefix caching skips a prefill it has seen before (the
    # shared-prefix part measures those)
    warm = {c: fresh(max(c, 4)) for c in levels}  # a few requests at each level: its batch sizes seen once (CUDA
    # graphs are captured, Triton kernels compiled for a batch size on first use: seconds that are not serving)
    prompts = {(r, c): fresh(max(8, 2 * c)) for r in range(rounds) for c in levels}
    runs = []
    with servers(specs, setup) as up:
        names = list(up)
        for name in names:  # warm-up: a few requests at each level
            for c in levels:
                asyncio.run(closed_loop(up[name].url, warm[c], 16, c))
        hf = None
        if "hf" in systems:  # (loaded while the servers idle: it shares their device)
            hf = HFStatic(setup)
            hf.run(warm[min(levels)][:2], 4, 2)
            names.append("hf")
        for r in range(rounds):
            for j, c in enumerate(levels):
                for name in rotated(names, r + j):
                    if name == "hf":
                        run, load = hf.run(prompts[r, c], output_len, c), {"loadavg_1m": os.getloadavg()[0],
                                                                          "other_cores": float("nan")}
                    else:
                        run, load = measured(up[name], lambda: asyncio.run(
                            closed_loop(up[name].url, prompts[r, c], output_len, c)))
                    row = {"system": name, "concurrency": c, "round": r + 1, **summarize(run), **load}
                    runs.append(row)
                    save(runs)
                    print(f"sweep round {r + 1}/{rounds} C={c} {name}: {row['out_tok_s']:.1f} tok/s, TTFT p50/p99 "
                          f"{row['ttft_p50_ms']:.0f}/{row['ttft_p99_ms']:.0f} ms, ITL p50/p99 {row['itl_p50_ms']:.1f}/{row['itl_p99_ms']:.1f} "
                          f"ms (load {load['loadavg_1m']:.1f}, others {load['other_cores']:.2f} cores)",
                          file=sys.stderr, flush=True)
    return {"runs": runs, "levels": levels, "systems": [s for s in systems if s not in setup["skipped"]],
            "input_len": input_len, "output_len": output_len, "kv_tokens": kv, "slots": top,
            "flags": {s: [str(x) for x in f[1]] for s, f in specs.items()},
            "hf": None if hf is None else hf.describe()}


class HFStatic:
    """The system `hf`: transformers' `generate` on the sweep's model in this process (an HF directory: its weights;
    a PMX directory: a LlamaForCausalLM of its shapes with random weights), float16 on CUDA, float32 on the CPU. A
    level of C requests runs its first C prompts as one static batch (left-padded, greedy, exactly output_len new
    tokens each), what transformers does without a serving layer: output tokens/s, TTFT (the batch's first new
    tokens) and ITL (the gaps between its steps), timed by a streamer at each step."""

    def __init__(self, setup: dict):
        import torch
        import transformers
        self.torch, self.device = torch, setup.get("device", "cpu")
        dtype = torch.float16 if self.device == "cuda" else torch.float32
        if setup["a"]["hf"] is not None:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(setup["a"]["hf"], torch_dtype=dtype)
            self.weights = str(setup["a"]["hf"])
        else:
            p = json.loads((setup["pmx_dir"] / "pmx_params.json").read_text())
            cfg = transformers.LlamaConfig(
                hidden_size=p["hidden_dim"], intermediate_size=p["intermediate_dim"], num_hidden_layers=p["num_layers"],
                num_attention_heads=p["num_heads"], num_key_value_heads=p["num_kv_heads"], vocab_size=p["vocab_size"],
                max_position_embeddings=p["max_position_embeddings"])   # (random weights: shapes are what count)
            with torch.device(self.device):
                self.model = transformers.LlamaForCausalLM(cfg).to(dtype)
            self.weights = f"random, the shapes of {setup['pmx_dir']}"
        self.model = self.model.to(self.device).eval()
        self.version = transformers.__version__

    def describe(self) -> dict:
        return {"transformers": self.version, "device": self.device, "weights": self.weights,
                "batching": "one static batch of C prompts per level (generate, greedy, left-padded)"}

    def run(self, prompts: list, output_len: int, concurrency: int) -> dict:
        """closed_loop's result for the first `concurrency` prompts as one batch."""
        torch = self.torch
        batch = prompts[:concurrency]
        width = max(len(x) for x in batch)
        ids = torch.tensor([[0] * (width - len(x)) + x for x in batch], device=self.device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch], device=self.device)
        clock = step_clock(self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                                do_sample=False, pad_token_id=0, eos_token_id=None, streamer=clock)
        new = clock.times[1:]                            # (times[0]: the prompt, put before the first step)
        req = {"ttft": new[0] - t0, "itl": [b - a for a, b in zip(new, new[1:])], "tokens": output_len,
               "chunks": len(new), "e2e": new[-1] - t0, "text": ""}
        return {"duration": time.perf_counter() - t0, "requests": [dict(req) for _ in batch]}


def step_clock(device: str):
    """A transformers streamer that records when each put arrives (the prompt, then each step's new tokens), after
    the device's work so far (CUDA: synchronised)."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class StepClock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            if device == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())

        def end(self):
            pass
    return StepClock()


def sweep_table(sw: dict) -> str:
    against = [b for b in ("llama.cpp", "base1", "hf") if b in sw["systems"]]
    head = ("| C | system | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | " +
            "".join(f"pmx1 / {b} tok/s | pmx1 / {b} ITL p99 | " for b in against) + "\n|" +
            "---|" * (7 + 2 * len(against)) + "\n")
    out = []
    for c in sw["levels"]:
        rows = {s: [x for x in sw["runs"] if x["system"] == s and x["concurrency"] == c] for s in sw["systems"]}
        ratios = []
        for b in against:  # (paired by round: the systems of a round ran one after another)
            ratio = itl = "-"
            if rows.get("pmx1") and rows.get(b):
                pairs = list(zip(sorted(rows["pmx1"], key=lambda x: x["round"]),
                                 sorted(rows[b], key=lambda x: x["round"])))
                ratio = spread([a["out_tok_s"] / y["out_tok_s"] for a, y in pairs], "{:.2f}")
                itl = spread([a["itl_p99_ms"] / y["itl_p99_ms"] for a, y in pairs], "{:.2f}")
            ratios += [ratio, itl]
        for k, (s, xs) in enumerate(rows.items()):
            if not xs:
                continue
            out.append(f"| {c} | {s} | {spread([x['out_tok_s'] for x in xs], '{:.1f}')} | "
                       f"{spread([x['ttft_p50_ms'] for x in xs])} | {spread([x['ttft_p99_ms'] for x in xs])} | "
                       f"{spread([x['itl_p50_ms'] for x in xs], '{:.1f}')} | "
                       f"{spread([x['itl_p99_ms'] for x in xs], '{:.1f}')} | " +
                       "".join(f"{r if k == 0 else ''} | " for r in ratios))
    return head + "\n".join(out) + "\n"


async def _sequential(urls: dict, prompts: list, output_len: int, order_seed: int = 0) -> dict:
    """Each prompt in turn to every system (rotating who goes first), one request at a time."""
    res = {n: [] for n in urls}
    async with httpx.AsyncClient(timeout=1800) as client:
        for i, p in enumerate(prompts):
            for n in rotated(list(urls), i + order_seed):
                res[n].append(await stream_request(client, urls[n], p, output_len))
    return res


def greedy_tokens(url: str, prompt: list, output_len: int) -> list:
    """A pmx server's greedy completion as its token strings (logprobs: 0), to check outputs token by token."""
    body = {"model": "model", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=1800).json()
    return r["choices"][0]["logprobs"]["tokens"]


def part_prefix(setup: dict, prefix_len: int, questions: int, output_len: int, rounds: int, seed: int) -> dict:
    rng = random.Random(seed + 1)
    kv = 4 * (prefix_len + 256)
    specs = {"pmx1": ("pmx1", pmx_flags(4, kv)),
             "pmx1-no-prefix-cache": ("pmx1", pmx_flags(4, kv, "--enable_prefix_caching", "false")),
             "llama.cpp": ("llama.cpp", llama_flags(4, kv))}
    res = {"prefix_len": prefix_len, "questions": questions, "output_len": output_len, "rounds": [],
           "flags": {s: [str(x) for x in f[1]] for s, f in specs.items()}}
    with servers(specs, setup) as up:
        urls = {n: s.url for n, s in up.items()}
        for r in range(rounds):  # a new system prompt each round: its first request is cold everywhere
            prefix = token_prompt(rng, prefix_len)
            prompts = [prefix + token_prompt(rng, rng.randint(12, 20), bos=False) for _ in range(questions)]
            before = {n: metrics(u) for n, u in urls.items() if n.startswith("pmx")}
            got = asyncio.run(_sequential(urls, prompts, output_len, r))
            after = {n: metrics(u) for n, u in urls.items() if n.startswith("pmx")}
            check = {}
            for n in ("pmx1", "pmx1-no-prefix-cache"):
                if n in urls:
                    check[n] = [greedy_tokens(urls[n], p, output_len) for p in prompts]
            same = None
            if len(check) == 2:
                same = [a == b for a, b in zip(*check.values())]
            rec = {"round": r + 1, "loadavg_1m": os.getloadavg()[0],
                   "ttft_ms": {n: [x["ttft"] * 1e3 for x in v] for n, v in got.items()},
                   "texts_equal": [len({got[n][i]["text"] for n in got if n.startswith("pmx")}) == 1
                                   for i in range(questions)],
                   "tokens_equal": same,
                   "prefix_cache_hit_pages": {n: after[n].get("prefix_cache_hits_total", 0) -
                                              before[n].get("prefix_cache_hits_total", 0) for n in after},
                   "prefix_cache_query_pages": {n: after[n].get("prefix_cache_queries_total", 0) -
                                                before[n].get("prefix_cache_queries_total", 0) for n in after}}
            res["rounds"].append(rec)
            print(f"prefix round {r + 1}/{rounds}: TTFT first / later (median, ms): " + ", ".join(
                f"{n} {v[0]:.0f} / {statistics.median(v[1:]):.0f}" for n, v in rec["ttft_ms"].items()) +
                f"; pmx outputs identical: {same}", file=sys.stderr, flush=True)
    return res


def prefix_table(pr: dict) -> str:
    names = list(pr["rounds"][0]["ttft_ms"]) if pr["rounds"] else []
    first = {n: [r["ttft_ms"][n][0] for r in pr["rounds"]] for n in names}
    later = {n: [x for r in pr["rounds"] for x in r["ttft_ms"][n][1:]] for n in names}
    out = ("| system | TTFT 1st request (ms) | TTFT 2nd and later, median (min-max) (ms) | p90 (ms) |\n"
           "|---|---|---|---|\n")
    for n in names:
        out += (f"| {n} | {spread(first[n])} | {spread(later[n])} | "
                f"{pct([x / 1e3 for x in later[n]], 90):.0f} |\n")
    if "pmx1" in later and "pmx1-no-prefix-cache" in later:
        ratios = [b / a for a, b in zip(later["pmx1"], later["pmx1-no-prefix-cache"])]
        out += (f"\nTTFT of the 2nd and later requests, prefix cache off / on, per request: median "
                f"{statistics.median(ratios):.1f}x, range {min(ratios):.1f}-{max(ratios):.1f}x over {len(ratios)}.")
    return out + "\n"


def part_spec(setup: dict, rounds: int, output_len: int, prompts_n: int, seed: int) -> dict:
    kv = 8192
    specs = {"pmx1": ("pmx1", pmx_flags(4, kv)), "pmx1-spec": ("pmx1", pmx_flags(4, kv, *SPEC_FLAGS))}
    res = {"output_len": output_len, "rounds": [], "flags": {s: [str(x) for x in f[1]] for s, f in specs.items()}}
    with servers(specs, setup) as up:
        urls = {n: s.url for n, s in up.items()}
        if len(urls) < 2:
            return res
        prompts = spec_prompts(urls["pmx1"], prompts_n, output_len)
        res["prompts"] = prompts
        asyncio.run(_sequential(urls, prompts[:1], 16))  # warm-up
        for r in range(rounds):
            before = {n: metrics(u) for n, u in urls.items()}
            got = asyncio.run(_sequential(urls, prompts, output_len, r))
            after = {n: metrics(u) for n, u in urls.items()}
            delta = {n: {k: v - before[n].get(k, 0) for k, v in after[n].items()} for n in urls}
            draft = delta["pmx1-spec"].get("spec_decode_draft_tokens_total", 0)
            acc = delta["pmx1-spec"].get("spec_decode_accepted_tokens_total", 0)
            # one request at a time, so a server's steps took its requests' time: the mean step (verify or decode)
            steps = {n: delta[n].get("steps_total", 0) for n in urls}
            rec = {"round": r + 1, "loadavg_1m": os.getloadavg()[0], "draft_tokens": draft, "accepted_tokens": acc,
                   "steps": steps, "step_ms": {n: 1e3 * sum(x["e2e"] for x in got[n]) / max(steps[n], 1)
                                               for n in urls},
                   "tokens_per_step": {n: sum(x["tokens"] for x in got[n]) / max(steps[n], 1) for n in urls},
                   "tok_s": {n: [x["tokens"] / x["e2e"] for x in v] for n, v in got.items()},
                   "decode_tok_s": {n: [(x["tokens"] - 1) / (x["e2e"] - x["ttft"]) for x in v] for n, v in got.items()},
                   "tokens_per_chunk": {n: [x["tokens"] / x["chunks"] for x in v] for n, v in got.items()},
                   "texts_equal": [got["pmx1"][i]["text"] == got["pmx1-spec"][i]["text"] for i in range(len(prompts))]}
            res["rounds"].append(rec)
            print(f"spec round {r + 1}/{rounds}: tok/s off {statistics.median(rec['tok_s']['pmx1']):.1f}, on "
                  f"{statistics.median(rec['tok_s']['pmx1-spec']):.1f}; acceptance {acc:.0f}/{draft:.0f}",
                  file=sys.stderr, flush=True)
        res["tokens_equal"] = [greedy_tokens(urls["pmx1"], p, output_len) == greedy_tokens(urls["pmx1-spec"], p,
                                                                                            output_len)
                               for p in prompts]
    if len(res["rounds"]):
        res["steps_offline"] = spec_step_costs(setup, res["prompts"], output_len, rounds)
    return res


OPENINGS = ("Once upon a time, there was a little girl named Lily.", "Tom had a big red ball.",
            "The cat sat on the mat.", "One day, a boy went to the park.", "Sue and her mom went to the shop.",
            "There was a dog who liked to run.")


def spec_prompts(url: str, n: int, output_len: int) -> list:
    """Editing requests (text): an opening X, the passage P the model writes after it (greedy, from the server
    without speculation), then X again, as an edit request quotes the text it edits and starts it again; prompt
    lookup finds the continuation's n-grams in the prompt wherever the model repeats P or itself."""
    out = []
    for x in (OPENINGS * n)[:n]:
        body = {"model": "model", "prompt": x, "max_tokens": output_len, "temperature": 0, "ignore_eos": True}
        passage = httpx.post(f"{url}/v1/completions", json=body, timeout=1800).json()["choices"][0]["text"]
        out.append(f"{x}{passage}\n\n{x}")
    return out


def spec_step_costs(setup: dict, prompts: list, output_len: int, rounds: int) -> dict:
    """The engine's steps on the spec prompts, offline in this process (no server, no HTTP): what a decode step
    costs as the one-call C++ step (the default), as the eager step (--fused_decode false, the path a verify step
    of several tokens a sequence takes) and what the steps of --speculative ngram cost, and the tokens each gives."""
    import torch
    from runner import LLM
    from runner.engine.sampler import SamplingParams as CoreParams
    torch.set_num_threads(setup["threads"])
    pmx, out = str(_pmx_model(1, setup["a"])), {}
    for name, opts in (("decode, one-call C++ step", {}), ("decode, eager step", {"fused_decode": False}),
                       ("ngram speculation", {"speculative": "ngram", "num_speculative_tokens": 4,
                                              "prompt_lookup_max": 4, "prompt_lookup_min": 1})):
        with LLM(pmx, max_batch=4, kv_cache_tokens=8192, **opts) as llm:
            core, ids = llm.engine.core, [llm.tokenizer.encode(p) for p in prompts]
            core.generate(ids[:1], 8, CoreParams(temperature=0))  # warm-up
            times, tokens, steps = [], 0, 0
            for _ in range(rounds):
                for p in ids:
                    stats, t0 = {}, time.perf_counter()
                    got = core.generate([p], output_len, CoreParams(temperature=0), stats=stats)
                    times.append(time.perf_counter() - t0)
                    tokens, steps = tokens + len(got[0]), steps + stats["steps"]
                    out.setdefault(name, {}).setdefault("step_s", []).extend(stats["step_seconds"])
        rec = out[name]
        rec.update(tokens=tokens, steps=steps, seconds=sum(times), tok_s=tokens / sum(times),
                   step_ms_median=1e3 * statistics.median(rec["step_s"]), step_ms_mean=1e3 * sum(rec.pop("step_s")) /
                   steps, tokens_per_step=tokens / steps)
        print(f"spec steps, {name}: {rec['tok_s']:.0f} tok/s, {rec['tokens_per_step']:.2f} tokens a step, step "
              f"median {rec['step_ms_median']:.3f} ms, mean {rec['step_ms_mean']:.3f} ms", file=sys.stderr, flush=True)
    return out


def spec_table(sp: dict) -> str:
    if not sp["rounds"]:
        return "(not run)\n"
    off = [x for r in sp["rounds"] for x in r["tok_s"]["pmx1"]]
    on = [x for r in sp["rounds"] for x in r["tok_s"]["pmx1-spec"]]
    ratios = [b / a for a, b in zip(off, on)]
    draft = sum(r["draft_tokens"] for r in sp["rounds"])
    acc = sum(r["accepted_tokens"] for r in sp["rounds"])
    return ("| system | output tok/s per request | decode tok/s | tokens per chunk | engine steps | mean step (ms) "
            "| tokens per step |\n|---|---|---|---|---|---|---|\n" +
            "".join(f"| {n} | {spread([x for r in sp['rounds'] for x in r['tok_s'][n]], '{:.1f}')} | "
                    f"{spread([x for r in sp['rounds'] for x in r['decode_tok_s'][n]], '{:.1f}')} | "
                    f"{spread([x for r in sp['rounds'] for x in r['tokens_per_chunk'][n]], '{:.2f}')} | "
                    f"{sum(r['steps'][n] for r in sp['rounds']):.0f} | "
                    f"{spread([r['step_ms'][n] for r in sp['rounds']], '{:.2f}')} | "
                    f"{spread([r['tokens_per_step'][n] for r in sp['rounds']], '{:.2f}')} |\n"
                    for n in ("pmx1", "pmx1-spec")) +
            f"\nspeculation on / off, per request: median {statistics.median(ratios):.2f}x (range "
            f"{min(ratios):.2f}-{max(ratios):.2f}); acceptance {acc:.0f} / {draft:.0f} drafted = "
            f"{acc / max(draft, 1):.2f}; outputs identical: texts {all(x for r in sp['rounds'] for x in r['texts_equal'])}"
            f", tokens {all(sp.get('tokens_equal', [False]))}\n" +
            ("\nOffline (the engine in this process, no server): \n\n| steps | tok/s | tokens per step | step median (ms) "
             "| step mean (ms) |\n|---|---|---|---|---|\n" + "".join(
                 f"| {n} | {v['tok_s']:.0f} | {v['tokens_per_step']:.2f} | {v['step_ms_median']:.3f} | "
                 f"{v['step_ms_mean']:.3f} |\n" for n, v in sp.get("steps_offline", {}).items())))


# -- commands ------------------------------------------------------------------------------------------------------
def _csv(x) -> list:
    return [str(v) for v in x] if isinstance(x, (list, tuple)) else [v.strip() for v in str(x).split(",") if v.strip()]


def run(parts: str = "agree,sweep,prefix,spec", model: str = "base", systems: str = "pmx1,llama.cpp",
        concurrency: str = "1,4,16,64", rounds: int = 3, input_len: int = 128, output_len: int = 128,
        prefix_len: int = 1500, questions: int = 8, prefix_output_len: int = 32, spec_output_len: int = 200,
        spec_prompts_n: int = 4, agree_tokens: int = 64, threads: int = 2, llama_cpp: str | None = None,
        seed: int = 0, workdir: str = str(CACHE), json_path: str | None = None, pmx_extra: str = "",
        baseline: str | None = None, device: str = "cpu", random_weights: bool = False) -> None:
    """Runs the parts asked for (see the module's docstring); prints their tables; writes the raw JSON.
    `pmx_extra`: flags added to every pmx-runner server (e.g. "--context_chunk_size 128"). `baseline`: another
    checkout of pmx-runner (e.g. a worktree of main), served as the system base1 (one rank) to compare pmx1 with.
    `device`: where the pmx servers (--device) and hf run: cpu or cuda. `random_weights`: the pmx servers serve
    random weights of the model's shapes (`serve --random_weights`: a PMX directory needs no shards)."""
    known = ("agree", "sweep", "prefix", "spec")
    chosen = list(known) if _csv(parts) == ["all"] else _csv(parts)
    if not chosen or set(chosen) - set(known):
        raise SystemExit(f"--parts: all, or some of {','.join(known)}, got {parts!r}")
    sysl = _csv(systems)
    if set(sysl) - {"pmx1", "pmx2", "llama.cpp", "base1", "hf"} or not sysl:
        raise SystemExit(f"--systems: some of pmx1,pmx2,llama.cpp,base1,hf, got {systems!r}")
    if device not in ("cpu", "cuda"):
        raise SystemExit(f"--device: cpu or cuda, got {device!r}")
    if ("base1" in sysl) != (baseline is not None) or (baseline and not (Path(baseline) / "runner").is_dir()):
        raise SystemExit(f"--systems base1 and --baseline DIR (a pmx-runner checkout) go together, got --baseline "
                         f"{baseline!r}")
    levels = [int(c) for c in _csv(concurrency)]
    setup = make_setup(model, threads, workdir, llama_cpp)
    setup["baseline"] = Path(baseline).resolve() if baseline else None
    setup["pmx_extra"] = tuple(shlex.split(pmx_extra))
    setup["device"] = device
    setup["random_weights"] = parse_bool("random_weights", random_weights)
    if setup.get("pmx_dir") and set(sysl) & {"llama.cpp"}:
        raise SystemExit(f"--model {model}: a PMX directory is served by the pmx systems (and hf) only")
    report = {"command": sys.argv[1:], "loadavg_start": os.getloadavg()}
    path = Path(json_path or REPO / "out" / f"serve_bench_{Path(model).name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    tables = []
    t0 = time.time()
    for part in chosen:
        if part == "agree":
            report["agree"] = part_agree(setup, agree_tokens, seed)
            tables.append("greedy agreement: " + ", ".join(
                f"{n}: first {v['agree_first']} of {agree_tokens} tokens" for n, v in
                report["agree"]["llama.cpp"].items()))
        elif part == "sweep":
            report["sweep"] = part_sweep(setup, sysl, levels, rounds, input_len, output_len, seed, lambda runs: (
                path.write_text(json.dumps({**report, "sweep_partial": runs}, indent=1))))
            tables.append(sweep_table(report["sweep"]))
        elif part == "prefix":
            report["prefix"] = part_prefix(setup, prefix_len, questions, prefix_output_len, rounds, seed)
            tables.append(prefix_table(report["prefix"]))
        else:
            report["spec"] = part_spec(setup, rounds, spec_output_len, spec_prompts_n, seed)
            tables.append(spec_table(report["spec"]))
        report.update(env=env_report(setup), skipped=setup["skipped"], loadavg_end=os.getloadavg(),
                      minutes=(time.time() - t0) / 60)
        path.write_text(json.dumps(report, indent=1))
    e = report["env"]
    print(f"\n{e['cpu']}; Python {e['python']}, torch {e['torch']}, pmx-runner {e['pmx-runner']}, llama.cpp "
          f"{e['llama.cpp']}; model {model}; {threads} threads; load {report['loadavg_start'][0]:.1f} -> "
          f"{report['loadavg_end'][0]:.1f}; {report['minutes']:.1f} min\n")
    print("\n\n".join(tables))
    for n, why in setup["skipped"].items():
        print(f"SKIPPED {n}: {why}")
    print(f"\nraw numbers: {path}")


if __name__ == "__main__":
    PARTS = {"all": "agree,sweep,prefix,spec", "agree": "agree", "sweep": "sweep", "prefix": "prefix", "spec": "spec"}
    if len(sys.argv) > 1 and sys.argv[1] in PARTS:  # `serve_bench.py sweep ...` is `serve_bench.py --parts sweep ...`
        sys.argv[1:2] = ["--parts", PARTS[sys.argv[1]]]
    fire.Fire(run)
