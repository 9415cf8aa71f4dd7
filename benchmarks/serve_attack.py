#!/usr/bin/env python3
"""Streams under attack: time to first token and inter-token latency (p50 / p99) of 16 normal streams on a quiet
server, and on the same server while a 50 MB request, 32 slow clients and a disconnect storm arrive.

    python benchmarks/serve_attack.py [--model ../shared/models/tinystories-656k] [--rounds 8] [--streams 16]
                                      [--max_tokens 400] [--attacks big,slow,storm] [--attacker_nice 19]
                                      [--json_path out/serve_attack.json]

One server (`python -m runner serve`, one rank, this checkout) on the model (an HF directory, converted once under
--workdir, default ~/.cache/pmx-runner/attack). Each round measures the 16 streams twice, quiet and attacked, the
order alternating from round to round; each measurement sends every stream's prompt at once (greedy, ignore_eos,
--max_tokens tokens, prompts of their own for every round and phase) and records each stream's time to its first
text and the gaps between its chunks. The attackers run in a process of their own (so that the measuring client
is not slowed by them), from a second before the streams start until they end. They stand for clients elsewhere,
whose own CPU is not the server's: on one box they run at niceness --attacker_nice (default 19), taking the cores
when the server leaves them. At niceness 10 a nice-0 task still yields ~10% of a contended core to each attacker
process, and at 0 the attackers' sending competes with the server as an equal: on 2 cores either measures the box
as much as the server (the attack's own counts, in the JSON, show the server took as many attacks at 19 as at 10).
--max_tokens 400 (the model's 512 positions less the prompts) makes a phase ~1.5-2 s: at 128 tokens a phase was
0.7 s, a fifth of it the streams' start, and one hiccup moved its p99:
  50 MB      one request at a time that announces a 50 MB JSON body and sends it as fast as it goes (the server
             answers 413 from its Content-Length and closes), again and again;
  slow       32 clients trickling a request's headers a byte every 0.5 s (the server drops them after
             --header_timeout; they reconnect);
  storm      8 clients sending whole streamed requests and closing the connection at once, again and again (a
             pause of 0.1 s between: ~80 a second)
             (--attacks storm_first: leaving after the first chunk instead, which costs the engine a prefill and a
             step each, as any request does).
The table gives each round's p50 / p99 and the attacked / quiet ratio of each (the target: within 1.2x); the box
is shared, so the JSON keeps every figure, the load average and the attack's own counts.
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
from pathlib import Path

import fire
import httpx

REPO = Path(__file__).resolve().parents[1]
STORM_PAUSE_S = 0.1  # each of the 8 storm clients: a request, then this pause (~80 a second in all; a flood past
                     # what the front end can take is a denial of service, which rate limits are for)
WORDS = ("the cat dog girl boy park ball tree sun happy big little red blue ran saw played found home mom friend "
         "day time said wanted looked went toy box bird fish water sky").split()


def _prompts(rng: random.Random, n: int) -> list:
    return ["Once upon a time, " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 40))) for _ in range(n)]


async def _stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    times = []
    async with client.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                              "temperature": 0, "ignore_eos": True,
                                                              "stream": True}) as r:
        if r.status_code != 200:
            return {"status": r.status_code}
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                times.append(time.perf_counter())
    return {"status": 200, "ttft": times[0] - t0 if times else None,
            "gaps": [b - a for a, b in zip(times, times[1:])]}


async def _measure(url: str, prompts: list, max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=64)) as c:
        runs = await asyncio.gather(*(_stream(c, p, max_tokens) for p in prompts))
    ttft = sorted(r["ttft"] for r in runs if r.get("ttft") is not None)
    gaps = sorted(g for r in runs for g in r.get("gaps", []))

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] * 1000 if xs else None
    return {"ok": sum(r["status"] == 200 for r in runs), "streams": len(runs),
            "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
            "itl_p50_ms": pct(gaps, 0.5), "itl_p99_ms": pct(gaps, 0.99), "chunks": len(gaps) + len(ttft)}


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list:
    out = []
    for p in (x for x in os.listdir("/proc") if x.isdigit()):
        try:
            if int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(p))
        except (OSError, ValueError, IndexError):
            pass
    return out


def _steps(url: str) -> tuple:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    get = {m.group(1): float(m.group(2)) for m in re.finditer(r"^pmx_(\w+) (\S+)$", text, re.M)}
    return get.get("steps_total", 0.0), get.get("generation_tokens_total", 0.0)


# -- the attackers (a process of their own) --------------------------------------------------------------------------
async def _big(host: str, port: int, until: dict, counts: dict) -> None:
    chunk = b"a" * (1 << 20)
    while time.monotonic() < until["t"]:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: attack\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 50000000\r\n\r\n{\"prompt\": \"")
            sent = 0
            while sent < 50_000_000 and time.monotonic() < until["t"]:
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
                if reader.at_eof():  # (the server answered and closed)
                    break
            head = await asyncio.wait_for(reader.read(200), 5)
            counts[head.split(b" ")[1].decode() if head.startswith(b"HTTP/") else "closed"] = \
                counts.get(head.split(b" ")[1].decode() if head.startswith(b"HTTP/") else "closed", 0) + 1
            writer.close()
        except (OSError, asyncio.TimeoutError, IndexError):
            counts["big reset"] = counts.get("big reset", 0) + 1
        await asyncio.sleep(0.1)


async def _slow(host: str, port: int, until: dict, counts: dict) -> None:
    while time.monotonic() < until["t"]:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: attack\r\n")
            while time.monotonic() < until["t"]:
                try:
                    got = await asyncio.wait_for(reader.read(100), 0.5)
                    if got or reader.at_eof():
                        counts["slow dropped"] = counts.get("slow dropped", 0) + 1
                        break
                except asyncio.TimeoutError:
                    writer.write(b"x")
                    await writer.drain()
            writer.close()
        except OSError:
            counts["slow reset"] = counts.get("slow reset", 0) + 1
            await asyncio.sleep(0.1)


async def _storm(host: str, port: int, until: dict, counts: dict, k: int) -> None:
    """Clients that send a whole streamed request and close the connection at once, again and again."""
    rng = random.Random(k)
    while time.monotonic() < until["t"]:
        body = json.dumps({"prompt": _prompts(rng, 1)[0], "max_tokens": 200, "stream": True}).encode()
        try:
            _, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: attack\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
            writer.close()
            counts["storm"] = counts.get("storm", 0) + 1
        except OSError:
            counts["storm error"] = counts.get("storm error", 0) + 1
        await asyncio.sleep(STORM_PAUSE_S)


async def _storm_first(url: str, until: dict, counts: dict, k: int) -> None:
    """Clients that start a stream and leave after its first chunk (each costs the engine a prefill and a step, as
    any request does)."""
    rng = random.Random(k)
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        while time.monotonic() < until["t"]:
            try:
                async with c.stream("POST", "/v1/completions", json={
                        "prompt": _prompts(rng, 1)[0], "max_tokens": 200, "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        break
                counts["storm_first"] = counts.get("storm_first", 0) + 1
            except httpx.HTTPError:
                counts["storm_first error"] = counts.get("storm_first error", 0) + 1
            await asyncio.sleep(STORM_PAUSE_S)


def attack(url: str, seconds: float, out: str, attacks: str = "big,slow,storm") -> None:
    """The attackers for `seconds` (run by the benchmark in a process of its own); their counts to `out`."""
    host, port = url.removeprefix("http://").split(":")
    counts: dict = {}
    until = {"t": time.monotonic() + seconds}
    signal.signal(signal.SIGTERM, lambda *_: until.update(t=0.0))  # (the benchmark's word: stop now)

    async def main():
        chosen = attacks.split(",") if isinstance(attacks, str) else list(attacks)
        await asyncio.gather(*([_big(host, int(port), until, counts)] if "big" in chosen else []),
                             *(_slow(host, int(port), until, counts) for _ in range(32 if "slow" in chosen else 0)),
                             *(_storm(host, int(port), until, counts, k) for k in range(8 if "storm" in chosen else 0)),
                             *(_storm_first(url, until, counts, k) for k in range(8 if "storm_first" in chosen else 0)))
    asyncio.run(main())
    Path(out).write_text(json.dumps(counts))


# -- the benchmark ---------------------------------------------------------------------------------------------------
def run(model: str = str(REPO.parent / "shared" / "models" / "tinystories-656k"), rounds: int = 8, streams: int = 16,
        max_tokens: int = 400, workdir: str = str(Path.home() / ".cache" / "pmx-runner" / "attack"),
        json_path: str = str(REPO / "out" / "serve_attack.json"), header_timeout: float = 10.0, seed: int = 0,
        attacks: str = "big,slow,storm", attacker_nice: int = 19) -> None:
    """See the module docstring; `attacks`: some of big, slow, storm, storm_first (to see what each costs)."""
    from runner.pmx.convert import convert
    work = Path(workdir)
    pmx = work / Path(model).name
    if not (pmx / "pmx_params.json").is_file():
        convert(model, str(pmx), progress=False)
    log = work / "server.log"
    cmd = [sys.executable, "-m", "runner", "serve", "--ckpt_dir", str(pmx), "--port", "0", "--kv_cache_tokens",
           str(streams * 2 * 512), "--max_batch", str(2 * streams + 8), "--header_timeout", str(header_timeout)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    rng = random.Random(seed)
    rows = []
    try:
        deadline = time.monotonic() + 300
        url = None
        while url is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)
            m = re.search(r"serving .* at (http://[\d.:]+)", log.read_text(errors="replace"))
            url = m.group(1) if m else None
        asyncio.run(_measure(url, _prompts(rng, streams), 16))  # warm-up
        front = _children(proc.pid)[0]
        for r in range(rounds):
            for phase in (("quiet", "attacked") if r % 2 == 0 else ("attacked", "quiet")):
                prompts = _prompts(rng, streams)
                attacker, counts = None, work / "attack.json"
                if phase == "attacked":
                    attacker = subprocess.Popen([sys.executable, __file__, "attack", "--url", url, "--seconds",
                                                 "600", "--out", str(counts), "--attacks", attacks], cwd=REPO,
                                                preexec_fn=lambda: os.nice(attacker_nice))
                    time.sleep(1.5)
                t0, steps0, cpu0 = time.monotonic(), _steps(url), (_cpu_s(proc.pid), _cpu_s(front))
                res = asyncio.run(_measure(url, prompts, max_tokens))
                steps1, cpu1 = _steps(url), (_cpu_s(proc.pid), _cpu_s(front))
                n = max(steps1[0] - steps0[0], 1)
                res.update(round=r + 1, phase=phase, seconds=round(time.monotonic() - t0, 2),
                           loadavg_1m=os.getloadavg()[0], engine_steps=n, tokens=steps1[1] - steps0[1],
                           engine_cpu_s=round(cpu1[0] - cpu0[0], 3), front_cpu_s=round(cpu1[1] - cpu0[1], 3),
                           engine_cpu_ms_per_step=round((cpu1[0] - cpu0[0]) * 1000 / n, 3),
                           engine_wall_share=round((cpu1[0] - cpu0[0]) / (time.monotonic() - t0), 3))
                if attacker is not None:
                    attacker.send_signal(signal.SIGTERM)
                    try:
                        attacker.wait(30)
                    except subprocess.TimeoutExpired:
                        attacker.kill()
                        attacker.wait()
                    res["attack"] = json.loads(counts.read_text()) if counts.exists() else None
                    counts.unlink(missing_ok=True)
                rows.append(res)
                print(f"round {r + 1} {phase:8}: TTFT p50 {res['ttft_p50_ms']:.1f} p99 {res['ttft_p99_ms']:.1f} ms, "
                      f"ITL p50 {res['itl_p50_ms']:.1f} p99 {res['itl_p99_ms']:.1f} ms, {res['ok']}/{streams} ok; "
                      f"engine {res['engine_steps']:.0f} steps, {res['tokens']:.0f} tokens, CPU "
                      f"{res['engine_cpu_ms_per_step']:.2f} ms a step, {res['engine_wall_share']:.2f} of a core; front "
                      f"end CPU {res['front_cpu_s']:.2f} s "
                      f"(load {res['loadavg_1m']:.1f}){'; attack ' + json.dumps(res.get('attack')) if attacker else ''}",
                      flush=True)
                time.sleep(2)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
    ratios = {}
    for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
        per = [next(x for x in rows if x["round"] == r and x["phase"] == "attacked")[key] /
               next(x for x in rows if x["round"] == r and x["phase"] == "quiet")[key] for r in range(1, rounds + 1)]
        ratios[key] = {"median": round(statistics.median(per), 3), "rounds": [round(x, 3) for x in per]}
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps({"model": model, "streams": streams, "max_tokens": max_tokens,
                                           "attacker_nice": attacker_nice, "rows": rows, "ratios": ratios}, indent=1))
    print("\n| metric | attacked / quiet (median) | per round |\n|---|---|---|")
    for key, v in ratios.items():
        print(f"| {key} | {v['median']:.2f} | {', '.join(f'{x:.2f}' for x in v['rounds'])} |")
    print(f"\nraw numbers: {json_path}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "attack":
        fire.Fire(attack, command=sys.argv[2:])
    else:
        fire.Fire(run)
