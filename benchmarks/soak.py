#!/usr/bin/env python3
"""Soak: the OpenAI server under the traffic an operator would try, for --seconds, then a SIGTERM drain; every check
below must hold, or it exits 1 naming what failed.

    python benchmarks/soak.py --seconds 600 [--ranks 2] [--clients 24] [--json_path out/soak.json]

The server: stories260k (../shared/models, converted and split into --ranks shards under --workdir, by default
~/.cache/pmx-runner/soak, which also holds the server's log) under
scripts/mpirun.sh -np RANKS, with a KV cache of 4 pages (512 tokens) so that sequences are preempted and the prefix
cache evicts, short header / body timeouts (2 s) and a 1 MB body limit. The traffic, all at once:
  valid        --clients clients sending, one after another, requests from a fixed set: greedy and seeded-sampled,
               streamed and not, n=2, stop strings, logprobs, prompts sharing a prefix, /tokenize; each must answer
               200 within 30 s, and every greedy request must get the same text each time it is sent.
  fuzz         malformed and extreme requests (lone surrogates, NULs, deep nesting, huge numbers, reserved template
               arguments, ids outside the vocabulary, bad types, invalid JSON and bytes, bodies over the limit,
               extreme but valid sampling values): a 4xx in OpenAI's JSON shape, or 200 for the valid ones.
  slow         clients that trickle their headers or their body a byte at a time: the server must drop them (408).
  disconnect   clients that leave mid-stream, before a non-streamed answer, or mid-body.
Checks: no 5xx; no request unanswered after 30 s; greedy outputs identical throughout; rank 0, rank 1 and the front
end's RSS, open files and threads flat (the last quarter's against the second's; files and threads back to their
start once idle); /metrics drained to no running or waiting sequence and no KV page used; no traceback in the log;
SIGTERM with streams open ends every stream (finished, or a shutting-down event) and every process with status 0
within --drain_timeout + 15 s, leaving none behind. Results (counts by kind and status, latencies, the resource
series, the drain) go to --json_path and a summary to stdout.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import fire
import httpx

REPO = Path(__file__).resolve().parents[1]
MARKER = "PMX_SOAK"
ANSWER_S = 30.0
PROMPTS = ["Once upon a time", "Lily", "The cat sat", "Tom had a big", "One day, a little", "The sun was"]
STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. " * 3
DEEP = b"[" * 100_000 + b"]" * 100_000


def _valid_cases() -> list:
    """(name, path, body, greedy) of the valid traffic."""
    cases = []
    for i, p in enumerate(PROMPTS):
        cases.append((f"greedy{i}", "/v1/completions", {"prompt": p, "max_tokens": 24 + 8 * i, "temperature": 0},
                      True))
        cases.append((f"stream{i}", "/v1/completions", {"prompt": p, "max_tokens": 32, "temperature": 0,
                                                        "stream": True, "ignore_eos": True}, True))
    cases += [
        ("prefix0", "/v1/completions", {"prompt": STORY + " The cat", "max_tokens": 40, "temperature": 0}, True),
        ("prefix1", "/v1/completions", {"prompt": STORY + " One day", "max_tokens": 40, "temperature": 0}, True),
        ("long", "/v1/completions", {"prompt": STORY * 2, "max_tokens": 60, "temperature": 0, "ignore_eos": True},
         True),
        ("stop", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0,
                                     "stop": ["Lily", "park"]}, True),
        ("n2", "/v1/completions", {"prompt": "The dog", "max_tokens": 30, "temperature": 0.8, "seed": 7, "n": 2},
         False),
        ("sampled", "/v1/completions", {"prompt": "Lily", "max_tokens": 30, "temperature": 1.0, "top_p": 0.9,
                                        "seed": 3, "stream": True}, False),
        ("logprobs", "/v1/completions", {"prompt": [1, 403, 407, 261, 378], "max_tokens": 12, "temperature": 0,
                                         "logprobs": 3}, True),
        ("penalties", "/v1/completions", {"prompt": "Once", "max_tokens": 20, "temperature": 0,
                                          "presence_penalty": 1.5, "repetition_penalty": 1.3}, True),
        ("tokenize", "/tokenize", {"prompt": STORY}, True),
    ]
    return cases


def _fuzz_bodies(rng: random.Random) -> tuple:
    """(path, raw body, headers, the status expected: a number, "4xx", or None for any below 500)."""
    json_h = {"content-type": "application/json"}
    pick = rng.randrange(14)
    if pick == 0:
        return "/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 4}', json_h, 400
    if pick == 1:
        return "/v1/completions", b'{"prompt": ' + DEEP[:2 * rng.randrange(300, 20000)] + b"}", json_h, 400
    if pick == 2:
        return "/v1/completions", b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", json_h, 400
    if pick == 3:
        k = rng.choice(["messages", "add_generation_prompt", "self", "bos_token"])
        return "/tokenize", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                        "chat_template_kwargs": {k: 1}}).encode(), json_h, 400
    if pick == 4:
        return "/v1/completions", json.dumps({"prompt": [[1, 2, 3]] * 64, "n": 64}).encode(), json_h, 400
    if pick == 5:
        return "/v1/completions", json.dumps({"prompt": [1, rng.randrange(512, 10 ** 6)]}).encode(), json_h, 400
    if pick == 6:
        return "/v1/completions", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))), json_h, "4xx"
    if pick == 7:
        field = rng.choice(["max_tokens", "n", "temperature", "top_p", "stop", "logprobs", "seed", "stream"])
        value = rng.choice(["x", -5, 1.5, [1], {"a": 1}, True, 10 ** 30, None])
        return "/v1/completions", json.dumps({"prompt": "Lily", "max_tokens": 2, field: value}).encode(), json_h, None
    if pick == 8:
        return "/v1/completions", b'{"prompt": "' + b"a" * (1 << 20) + b'"}', json_h, 413
    if pick == 9:
        return "/v1/completions", b'{"prompt": "a\\u0000b", "model": "\\udc00"}', json_h, 400
    if pick == 10:
        return "/detokenize", json.dumps({"tokens": [rng.randrange(-5, 10 ** 6) for _ in range(5)]}).encode(), \
            json_h, "4xx"
    if pick == 11:
        return "/v1/nowhere", b"{}", json_h, 404
    if pick == 12:
        return "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), \
            json_h, 400  # (stories260k has no chat template)
    extreme = rng.choice([{"temperature": 1e-300}, {"temperature": 1e300}, {"top_p": 5e-324}, {"min_p": 1.0},
                          {"repetition_penalty": 1e-300}, {"presence_penalty": -2, "frequency_penalty": 2},
                          {"logit_bias": {str(i): 100 for i in range(0, 512, 5)}}])
    return "/v1/completions", json.dumps({"prompt": "Once", "max_tokens": 4, **extreme}).encode(), json_h, 200


class Soak:
    def __init__(self, url: str, clients: int, seconds: float, rng_seed: int):
        self.url, self.clients, self.seconds = url, clients, seconds
        self.rng = random.Random(rng_seed)
        self.host, self.port = url.removeprefix("http://").split(":")
        self.counts: dict = {}          # (kind, status) -> n
        self.latency: dict = {}         # kind -> [seconds]
        self.failures: list = []        # one line each
        self.greedy: dict = {}          # case name -> text
        self.mismatches = 0
        self.unanswered = 0
        self.stop_at = 0.0

    def count(self, kind: str, status, took: float) -> None:
        self.counts[(kind, status)] = self.counts.get((kind, status), 0) + 1
        self.latency.setdefault(kind, []).append(took)
        if isinstance(status, int) and status >= 500:
            self.failures.append(f"{kind}: status {status}")

    async def valid(self, k: int) -> None:
        cases = _valid_cases()
        rng = random.Random(k)
        async with httpx.AsyncClient(base_url=self.url, timeout=ANSWER_S) as c:
            while time.monotonic() < self.stop_at:
                name, path, body, greedy = rng.choice(cases)
                t0 = time.monotonic()
                try:
                    if body.get("stream"):
                        text, status = "", None
                        async with c.stream("POST", path, json=body) as r:
                            status = r.status_code
                            async for line in r.aiter_lines():
                                if line.startswith("data: {"):
                                    chunk = json.loads(line[6:])
                                    if "error" in chunk:
                                        self.failures.append(f"{name}: stream error {chunk['error']}")
                                    for ch in chunk.get("choices", []):
                                        text += ch.get("text", "")
                    else:
                        r = await c.post(path, json=body)
                        status = r.status_code
                        out = r.json()
                        text = json.dumps(out.get("tokens")) if path == "/tokenize" else \
                            "|".join(ch["text"] for ch in sorted(out.get("choices", []), key=lambda x: x["index"]))
                except httpx.TimeoutException:
                    self.unanswered += 1
                    self.failures.append(f"{name}: no answer within {ANSWER_S:g} s")
                    continue
                except httpx.HTTPError as e:
                    self.failures.append(f"{name}: {type(e).__name__}: {e}")
                    continue
                self.count("valid", status, time.monotonic() - t0)
                if status != 200:
                    self.failures.append(f"{name}: status {status}")
                elif greedy:
                    want = self.greedy.setdefault(name, text)
                    if text != want:
                        self.mismatches += 1
                        self.failures.append(f"{name}: greedy output changed: {want[:60]!r} -> {text[:60]!r}")

    async def fuzz(self, k: int) -> None:
        rng = random.Random(1000 + k)
        async with httpx.AsyncClient(base_url=self.url, timeout=ANSWER_S) as c:
            while time.monotonic() < self.stop_at:
                path, raw, headers, want = _fuzz_bodies(rng)
                t0 = time.monotonic()
                try:
                    r = await c.post(path, content=raw, headers=headers)
                except httpx.TimeoutException:
                    self.unanswered += 1
                    self.failures.append(f"fuzz {path}: no answer within {ANSWER_S:g} s")
                    continue
                except httpx.HTTPError:  # (a 413 may close the connection while the body is still being sent)
                    self.count("fuzz", "closed", time.monotonic() - t0)
                    continue
                self.count("fuzz", r.status_code, time.monotonic() - t0)
                ok = r.status_code < 500 if want is None else 400 <= r.status_code < 500 if want == "4xx" else \
                    r.status_code == want
                if not ok:
                    self.failures.append(f"fuzz {path}: status {r.status_code}, wanted {want or 'below 500'}: "
                                         f"{r.text[:120]}")
                if r.status_code >= 400:
                    try:
                        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
                    except (ValueError, KeyError, AssertionError, TypeError):
                        self.failures.append(f"fuzz {path}: not OpenAI's error shape: {r.text[:120]}")

    async def slow(self, k: int) -> None:
        rng = random.Random(2000 + k)
        while time.monotonic() < self.stop_at:
            headers_only = rng.random() < 0.5
            data = b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n" + (
                b"" if headers_only else b'Content-Length: 200\r\n\r\n{"prompt": "')
            t0 = time.monotonic()
            try:
                reader, writer = await asyncio.open_connection(self.host, int(self.port))
            except OSError as e:
                self.failures.append(f"slow: cannot connect ({e})")
                await asyncio.sleep(1)
                continue
            got = b""
            try:
                writer.write(data)
                while time.monotonic() - t0 < ANSWER_S:  # a byte every 0.3 s until the server closes
                    try:
                        got += await asyncio.wait_for(reader.read(4096), 0.3)
                        if reader.at_eof():
                            break
                    except asyncio.TimeoutError:
                        writer.write(b"a")
                        await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()
            status = int(got.split()[1]) if got.startswith(b"HTTP/1.1 ") else "closed"
            self.count("slow", status, time.monotonic() - t0)
            if status != 408:
                self.failures.append(f"slow: {status} after {time.monotonic() - t0:.1f} s, wanted 408")

    async def disconnect(self, k: int) -> None:
        rng = random.Random(3000 + k)
        while time.monotonic() < self.stop_at:
            how = rng.randrange(3)
            t0 = time.monotonic()
            try:
                if how == 0:  # mid-stream
                    async with httpx.AsyncClient(base_url=self.url, timeout=ANSWER_S) as c:
                        async with c.stream("POST", "/v1/completions", json={
                                "prompt": rng.choice(PROMPTS), "max_tokens": 200, "ignore_eos": True,
                                "stream": True}) as r:
                            n = rng.randrange(1, 4)
                            async for _ in r.aiter_lines():
                                n -= 1
                                if n <= 0:
                                    break
                elif how == 1:  # before a non-streamed answer
                    async with httpx.AsyncClient(base_url=self.url, timeout=rng.uniform(0.02, 0.3)) as c:
                        try:
                            await c.post("/v1/completions", json={"prompt": STORY, "max_tokens": 100,
                                                                  "ignore_eos": True})
                        except httpx.TimeoutException:
                            pass
                else:  # mid-body
                    reader, writer = await asyncio.open_connection(self.host, int(self.port))
                    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Length: 500\r\n\r\n"
                                 b'{"prompt": ')
                    await writer.drain()
                    await asyncio.sleep(rng.uniform(0, 0.2))
                    writer.close()
            except (httpx.HTTPError, OSError) as e:
                self.failures.append(f"disconnect: {type(e).__name__}: {e}")
            self.count("disconnect", how, time.monotonic() - t0)
            await asyncio.sleep(rng.uniform(0, 0.1))

    async def run(self, probe) -> None:
        self.stop_at = time.monotonic() + self.seconds
        tasks = [self.valid(k) for k in range(self.clients)] + [self.fuzz(k) for k in range(2)] + \
            [self.slow(k) for k in range(4)] + [self.disconnect(k) for k in range(3)] + [probe(self)]
        await asyncio.gather(*tasks)


# -- processes ------------------------------------------------------------------------------------------------------
def _environ(pid: str) -> dict:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)


def marked(marker: str) -> dict:
    """{pid: role} of the live processes carrying `marker`: "rank R", "front end", or "launcher"."""
    out = {}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        env = _environ(pid)
        if env.get(MARKER.encode()) != marker.encode():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        rank = env.get(b"PMI_RANK") or env.get(b"RANK")
        if b"runner.serve.frontend" in cmd:
            out[int(pid)] = "front end"
        elif rank is not None and b"runner" in cmd:
            out[int(pid)] = f"rank {rank.decode()}"
        else:
            out[int(pid)] = "launcher"
    return out


def usage(pid: int) -> dict:
    """RSS (MiB), open files and threads of a process."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return {}
    rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024
    return {"rss_mib": round(rss, 1), "fds": fds, "threads": int(re.search(r"Threads:\s+(\d+)", status).group(1))}


def _prepare(workdir: Path, ranks: int, model: Path) -> Path:
    from runner.pmx.convert import convert, reshard
    one = workdir / "pmx"
    if not (one / "pmx_params.json").is_file():
        convert(str(model), str(one), progress=False)
    if ranks == 1:
        return one
    split = workdir / f"pmx{ranks}"
    if not (split / "pmx_params.json").is_file():
        reshard(str(one), str(split), ranks, progress=False)
    return split


def _metrics(url: str) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^pmx_(\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def _flat(series: list, key: str) -> dict:
    """The second quarter's and the last quarter's mean of `key` (after the first quarter's warm-up)."""
    vals = [s[key] for s in series if key in s]
    q = max(len(vals) // 4, 1)
    early, late = vals[q:2 * q] or vals[:1], vals[-q:]
    return {"early": round(statistics.mean(early), 1), "late": round(statistics.mean(late), 1),
            "max": max(vals), "min": min(vals)}


def main(seconds: float = 60, ranks: int = 2, clients: int = 24, workdir: str = "", json_path: str = "",
         model: str = str(REPO.parent / "shared" / "models" / "stories260k"), seed: int = 0,
         drain_timeout: float = 5.0) -> None:
    """Soak the server for `seconds`; see the module docstring."""
    work = Path(workdir) if workdir else Path.home() / ".cache" / "pmx-runner" / "soak"
    work.mkdir(parents=True, exist_ok=True)
    ckpt = _prepare(work, ranks, Path(model))
    marker = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "runner", "serve", "--ckpt_dir", str(ckpt), "--host", "127.0.0.1", "--port", "0",
           "--kv_cache_tokens", "512", "--max_batch", "8", "--max_num_batched_tokens", "128",
           "--max_waiting", str(4 * clients), "--header_timeout", "2", "--body_timeout", "2",
           "--max_request_bytes", str(1 << 20), "--drain_timeout", str(drain_timeout)]
    if ranks > 1:
        cmd = [str(REPO / "scripts" / "mpirun.sh"), "-np", str(ranks), *cmd]
    log = work / "server.log"
    env = {**os.environ, MARKER: marker, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
    result: dict = {"seconds": seconds, "ranks": ranks, "clients": clients, "checks": {}}
    failures: list = []
    try:
        deadline = time.monotonic() + 300
        url = None
        while url is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"soak: the server did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)
            m = re.search(r"serving .* at (http://[\d.:]+)", log.read_text(errors="replace"))
            url = m.group(1) if m else None
        time.sleep(1)
        procs = {pid: role for pid, role in marked(marker).items() if role != "launcher"}
        start = {role: usage(pid) for pid, role in procs.items()}
        series: list = []

        async def probe(s: Soak) -> None:
            async with httpx.AsyncClient(base_url=url, timeout=ANSWER_S) as c:
                while time.monotonic() < s.stop_at:
                    t0 = time.monotonic()
                    r = await c.get("/health")
                    s.count("health", r.status_code, time.monotonic() - t0)
                    series.append({"t": round(time.monotonic() - (s.stop_at - seconds), 1),
                                   **{f"{role} {k}": v for pid, role in procs.items()
                                      for k, v in usage(pid).items()}})
                    await asyncio.sleep(2)

        soak = Soak(url, clients, seconds, seed)
        print(f"soak: {seconds:g} s against {url} ({ranks} rank(s), {clients} valid clients, 2 fuzzers, 4 slow "
              f"clients, 3 disconnecters)", flush=True)
        asyncio.run(soak.run(probe))
        failures += soak.failures
        drained, t0 = None, time.monotonic()
        while time.monotonic() - t0 < 30:
            m = _metrics(url)
            if m.get("requests_running") == 0 and m.get("requests_waiting") == 0 and m.get("kv_pages_used") == 0:
                drained = round(time.monotonic() - t0, 2)
                break
            time.sleep(0.5)
        if drained is None:
            failures.append(f"/metrics not drained 30 s after the traffic: {m}")
        time.sleep(3)  # (keep-alive connections closed, threads parked)
        idle = {role: usage(pid) for pid, role in procs.items()}
        resources = {}
        for role in sorted(set(procs.values())):
            r = {k: _flat(series, f"{role} {k}") for k in ("rss_mib", "fds", "threads")}
            r["start"], r["idle_after"] = start[role], idle[role]
            resources[role] = r
            rss = r["rss_mib"]
            if rss["late"] > rss["early"] * 1.10 + 16:
                failures.append(f"{role}: RSS grew from {rss['early']} to {rss['late']} MiB")
            if idle[role].get("fds", 0) > start[role].get("fds", 0) + 4:
                failures.append(f"{role}: {idle[role]['fds']} files open once idle, {start[role]['fds']} at start")
            if idle[role].get("threads", 0) > start[role].get("threads", 0) + 2 or \
                    r["threads"]["max"] > start[role].get("threads", 0) + 8:
                failures.append(f"{role}: threads {start[role]['threads']} at start, {idle[role]['threads']} idle "
                                f"after, {r['threads']['max']} at most")
        metrics = _metrics(url)
        result.update(url=url, drained_s=drained, resources=resources, series=series,
                      counts={f"{k} {s}": n for (k, s), n in sorted(soak.counts.items(), key=str)},
                      latency={k: {"n": len(v), "p50_s": round(statistics.median(v), 4),
                                   "p99_s": round(sorted(v)[int(0.99 * (len(v) - 1))], 4), "max_s": round(max(v), 3)}
                               for k, v in soak.latency.items()},
                      greedy_cases=len(soak.greedy), mismatches=soak.mismatches, unanswered=soak.unanswered,
                      server_metrics={k: v for k, v in metrics.items() if not k.endswith("_created")
                                      and "bucket" not in k})
        result["drain"] = _drain(url, proc, marker, drain_timeout)
        failures += result["drain"].pop("failures")
        text = log.read_text(errors="replace")
        for bad in ("Traceback", "Exception in ASGI", "error "):
            if bad in text:
                failures.append(f"the server's log holds {bad!r}: see {log}")
        result["log_lines_went_away"] = text.count("went away")
        result["log_lines_dropped_slow"] = text.count("within 2 s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in marked(marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    result["failures"] = failures
    fivexx = sum(n for (k, s), n in soak.counts.items() if isinstance(s, int) and s >= 500)
    result["checks"] = {"no 5xx": fivexx == 0, "every request answered within 30 s": soak.unanswered == 0,
                        "greedy outputs identical": soak.mismatches == 0 and len(soak.greedy) > 0,
                        "all clean": not failures}
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1))
    _summary(result)
    if failures:
        print("soak FAILED:\n  " + "\n  ".join(failures[:40]), flush=True)
        raise SystemExit(1)
    print("soak passed", flush=True)


def _drain(url: str, proc: subprocess.Popen, marker: str, drain_timeout: float) -> dict:
    """SIGTERM with 4 long streams open: each ends (finished, or a shutting-down event), every process exits 0 within
    drain_timeout + 15 s, none is left."""
    out: dict = {"failures": []}

    async def streams() -> list:
        started = [asyncio.Event() for _ in range(4)]  # (SIGTERM once every stream is in: one still arriving is
        # refused with 503, rightly)

        async def one(i: int):
            try:
                async with httpx.AsyncClient(base_url=url, timeout=ANSWER_S) as c:
                    async with c.stream("POST", "/v1/completions", json={
                            "prompt": PROMPTS[i], "max_tokens": 300, "ignore_eos": True, "stream": True,
                            "seed": i}) as r:
                        if r.status_code != 200:
                            started[i].set()
                            return f"status {r.status_code}"
                        end = None
                        async for line in r.aiter_lines():
                            started[i].set()
                            if "shutting down" in line:
                                end = "cancelled"
                            elif line.startswith("data: {"):
                                for ch in json.loads(line[6:]).get("choices", []):
                                    end = ch.get("finish_reason") or end
                        return end or "no end"
            except httpx.HTTPError as e:
                started[i].set()
                return f"{type(e).__name__}"

        tasks = [asyncio.ensure_future(one(i)) for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        os.killpg(proc.pid, signal.SIGTERM)  # (what a terminal's Ctrl-C or a process manager's stop does)
        return await asyncio.gather(*tasks)

    t0 = time.monotonic()
    ends = asyncio.run(streams())
    try:
        rc = proc.wait(drain_timeout + 15)
    except subprocess.TimeoutExpired:
        rc = None
    out.update(stream_ends=ends, exit_status=rc, took_s=round(time.monotonic() - t0, 2))
    time.sleep(2)
    left = marked(marker)
    out["left_behind"] = sorted(left.values())
    if rc != 0:
        out["failures"].append(f"SIGTERM: the server exited with {rc}")
    if not all(e in ("length", "cancelled") for e in ends):
        out["failures"].append(f"SIGTERM: streams ended {ends}")
    if left:
        out["failures"].append(f"SIGTERM: left behind {sorted(left.values())}")
    return out


def _summary(r: dict) -> None:
    print(f"soak: {r['seconds']:g} s, {r['ranks']} rank(s): " + ", ".join(f"{k}: {v}" for k, v in r["checks"].items()))
    for k, v in r.get("counts", {}).items():
        print(f"  {k:24} {v}")
    for k, v in r.get("latency", {}).items():
        print(f"  latency {k:12} n={v['n']} p50 {v['p50_s'] * 1000:.1f} ms  p99 {v['p99_s'] * 1000:.1f} ms  "
              f"max {v['max_s']:.2f} s")
    for role, res in r.get("resources", {}).items():
        print(f"  {role:10} RSS MiB {res['rss_mib']['early']} -> {res['rss_mib']['late']} (max {res['rss_mib']['max']}),"
              f" files {res['start'].get('fds')} at start / {res['idle_after'].get('fds')} idle after (max "
              f"{res['fds']['max']}), threads {res['start'].get('threads')} / {res['idle_after'].get('threads')} "
              f"(max {res['threads']['max']})")
    if "drained_s" in r:
        print(f"  /metrics drained {r['drained_s']} s after the traffic; greedy cases {r.get('greedy_cases')}, "
              f"mismatches {r.get('mismatches')}, unanswered {r.get('unanswered')}")
    if "drain" in r:
        d = r["drain"]
        print(f"  SIGTERM: exit {d.get('exit_status')} in {d.get('took_s')} s, streams {d.get('stream_ends')}, "
              f"left behind {d.get('left_behind')}")


if __name__ == "__main__":
    fire.Fire(main)
