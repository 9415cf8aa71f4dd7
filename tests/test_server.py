"""The HTTP server end to end with the official `openai` client, on 127.0.0.1: one process and mpirun -np 2
(and a torchrun smoke test). Every server is stopped with SIGTERM and must exit 0, leaving no process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sys
import time

import httpx
import openai
import pytest

from jobs import Job, launch_cmd, proc_stat
from runner.pmx.convert import reshard
from runner.serve.params import SamplingParams
from test_serve import REFERENCE_TEXT, one_thread, stories  # noqa: F401 (fixtures)

START_TIMEOUT = 180
LONG_PROMPT = " ".join([REFERENCE_TEXT.strip(", ")] * 9)  # ~300 tokens: prefilled in chunks of 256


class Server:
    def __init__(self, job: Job):
        self.job = job
        self.url = re.search(r"serving .* at (http://127\.0\.0\.1:\d+)", job.stderr).group(1)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)
        self.model = self.client.models.list().data[0].id

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        m = re.search(rf"^pmx_{re.escape(name)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self, timeout: float = 30, launcher_rc=(0,)) -> float:
        """SIGTERM to the launcher; asserts a clean stop, its exit status and no process left. Returns the
        seconds it took."""
        t0 = time.monotonic()
        self.job.proc.send_signal(signal.SIGTERM)
        rc = self.job.wait(timeout)
        took = time.monotonic() - t0
        left = self.job.lingering()
        assert rc in launcher_rc and not left, f"exit {rc}, left {left}:\n{self.job.stderr[-3000:]}"
        assert self.job.stderr.count("server stopped") == 1, self.job.stderr[-3000:]
        return took


def start(tmp_path, launcher: str, n: int, ckpt, *flags) -> Server:
    cmd = [sys.executable, "-m", "runner", "serve", "--ckpt_dir", ckpt, "--host", "127.0.0.1", "--port", 0, *flags]
    env = {"OMP_NUM_THREADS": "1"}
    if launcher != "single":
        cmd, extra = launch_cmd(launcher, n, *cmd)
        env.update(extra)
    job = Job(cmd, tmp_path, env)
    try:
        job.wait_for("serving ", START_TIMEOUT)
        return Server(job)
    except BaseException:
        job.cleanup()
        raise


@pytest.fixture(scope="module")
def offline(stories):
    from runner import LLM
    with LLM(str(stories["pmx"]), kv_cache_tokens=8192, max_batch=32) as m:
        yield m


@pytest.fixture(scope="module")
def server(stories, tmp_path_factory):
    """One process, the chat-template copy of stories260k."""
    srv = start(tmp_path_factory.mktemp("srv1"), "single", 1, stories["chat"], "--served_model_name", "stories",
                "--kv_cache_tokens", 4096, "--max_batch", 16, "--max_num_batched_tokens", 256, "--max_waiting", 64,
                "--max_request_bytes", 1 << 20, "--header_timeout", 1, "--body_timeout", 1, "--max_connections", 48)
    try:
        yield srv
        assert srv.stop() < 15
    finally:
        srv.job.cleanup()


@pytest.fixture(scope="module")
def tp2_server(stories, tmp_path_factory):
    """mpirun -np 2, no chat template, a 2-page KV cache, 4 sequences at most, 6 waiting at most."""
    tmp = tmp_path_factory.mktemp("srv2")
    reshard(str(stories["pmx"]), str(tmp / "pmx2"), 2, progress=False)
    srv = start(tmp, "mpich", 2, tmp / "pmx2", "--kv_cache_tokens", 256, "--max_batch", 4,
                "--max_num_batched_tokens", 64, "--max_waiting", 6, "--drain_timeout", 0.1)
    try:
        yield srv
    finally:
        srv.job.cleanup()


# -- one process ----------------------------------------------------------------------------------
def test_completions_reference_text_streamed_and_not(server):
    c = server.client
    r = c.completions.create(model="stories", prompt="Once upon a time", max_tokens=40, temperature=0)
    assert r.choices[0].text == REFERENCE_TEXT and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 40, 45)
    chunks = list(c.completions.create(model="stories", prompt="Once upon a time", max_tokens=40, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == REFERENCE_TEXT
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 40 and not chunks[-1].choices
    ids = c.completions.create(model="stories", prompt=[1, 403, 407, 261, 378], max_tokens=40, temperature=0,
                               logprobs=2)
    lp = ids.choices[0].logprobs
    assert "".join(lp.tokens) == REFERENCE_TEXT and len(lp.top_logprobs) == 40
    assert all(len(t) == 2 and max(t.values()) == v for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset[:3] == [0, 1, 7]
    echo = c.completions.create(model="stories", prompt="Once upon a time", max_tokens=40, temperature=0, echo=True)
    assert echo.choices[0].text == "Once upon a time" + REFERENCE_TEXT
    raw = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Lily", "max_tokens": 3, "stream": True},
                     timeout=60).text
    assert raw.endswith("data: [DONE]\n\n") and raw.startswith("data: {")


def test_chat_completions_with_the_models_template(server):
    c = server.client
    msgs = [{"role": "user", "content": "Once upon a time"}]
    r = c.chat.completions.create(model="stories", messages=msgs, max_tokens=40, temperature=0)
    assert r.choices[0].message.content == REFERENCE_TEXT and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == 5 and r.object == "chat.completion"
    chunks = list(c.chat.completions.create(model="stories", messages=msgs, max_completion_tokens=40, temperature=0,
                                            stream=True, logprobs=True, top_logprobs=1))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == REFERENCE_TEXT
    assert chunks[-1].choices[0].finish_reason == "length"
    tokens = [t.token for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert "".join(tokens) == REFERENCE_TEXT
    with pytest.raises(openai.BadRequestError, match="unknown role tool"):
        c.chat.completions.create(model="stories", messages=[{"role": "tool", "content": "x"}])


def test_models_health_metrics(server):
    m = server.client.models.list().data
    assert [x.id for x in m] == ["stories"] and m[0].owned_by == "pmx-runner"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in ("requests_total", "prompt_tokens_total", "generation_tokens_total", "requests_waiting",
                 "requests_running", "kv_pages_used", "kv_pages_free", "time_to_first_token_seconds",
                 "inter_token_latency_seconds"):
        assert f"# TYPE pmx_{name} " in text
    assert server.metric("kv_pages_total") == 32 and server.metric("generation_tokens_total") > 0


def test_dozens_of_concurrent_mixed_requests(server, offline):
    """32 requests at once: short and long prompts (chunked prefill beside decoding), greedy and sampled,
    streamed and not, n=2, stops. Every one is answered; the greedy ones match the offline API."""
    prompts = ["Once upon a time", "Lily", "The cat", LONG_PROMPT, "Tom had a", "One day"]
    cases = []
    for i in range(32):
        greedy = i % 2 == 0
        cases.append(dict(prompt=prompts[i % len(prompts)], max_tokens=[8, 24, 60, 100][i % 4],
                          temperature=0.0 if greedy else 0.8, top_p=1.0 if greedy else 0.9, seed=i,
                          n=2 if i % 8 == 3 else 1, stop=["zebra"] if i % 5 == 0 else None, stream=i % 3 == 0))
    want = offline.generate([k["prompt"] for k in cases],
                            [SamplingParams(max_tokens=k["max_tokens"], temperature=k["temperature"],
                                            top_p=k["top_p"], n=k["n"], stop=k["stop"]) for k in cases])

    async def one(client, k):
        r = await client.completions.create(model="stories", **{x: v for x, v in k.items() if v is not None})
        if not k["stream"]:
            return {c.index: (c.text, c.finish_reason) for c in r.choices}
        texts, reasons = {}, {}
        async for ch in r:
            for c in ch.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                reasons[c.index] = c.finish_reason or reasons.get(c.index)
        return {i: (texts[i], reasons[i]) for i in texts}

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, k) for k in cases)), 300)

    got = asyncio.run(main())
    for k, g, w in zip(cases, got, want):
        assert sorted(g) == list(range(k["n"])) and all(r in ("stop", "length") for _, r in g.values())
        if k["temperature"] == 0:
            assert g[0] == (w.outputs[0].text, w.outputs[0].finish_reason), k
    assert server.metric("kv_pages_used") == 0 and server.metric("requests_running") == 0


def test_disconnect_mid_stream_frees_its_pages(server):
    aborted = server.metric('requests_total{reason="abort"}')
    stream = server.client.completions.create(model="stories", prompt="Once upon a time", max_tokens=480,
                                              temperature=0.7, extra_body={"ignore_eos": True}, stream=True)
    it = iter(stream)
    for _ in range(3):
        next(it)
    assert server.metric("kv_pages_used") > 0
    stream.close()
    deadline = time.monotonic() + 20
    while server.metric("kv_pages_used") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("kv_pages_used") == 0 and server.metric("kv_pages_free") == 32
    assert server.metric('requests_total{reason="abort"}') == aborted + 1  # cancelled, not run to its end


def test_bad_requests_get_openai_errors_and_the_server_stays_up(server):
    def post(path, body, status, param=None, text=None):
        r = httpx.post(f"{server.url}{path}", content=body if isinstance(body, bytes) else json.dumps(body),
                       headers={"content-type": "application/json"}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == status and err["code"] == status and err["message"], r.text
        assert param is None or err["param"] == param, r.text
        assert text is None or text in err["message"], r.text

    ok = {"prompt": "Lily", "max_tokens": 2}
    post("/v1/completions", b"{not json", 400, text="not valid JSON")
    post("/v1/completions", b"[1, 2]", 400, text="JSON object")
    for field, value in [("max_tokens", "ten"), ("temperature", "hot"), ("stream", "yes"), ("n", 1.5),
                         ("stop", [1]), ("seed", "x"), ("logprobs", True)]:
        post("/v1/completions", {**ok, field: value}, 400, field)
    for field, value in [("max_tokens", 0), ("temperature", -1), ("top_p", 1.5), ("n", 0), ("logprobs", 30),
                         ("top_k", -2), ("presence_penalty", 2.5), ("min_p", 1.5), ("logit_bias", {"x": 1}),
                         ("logit_bias", {"5000": 1}), ("repetition_penalty", 0)]:
        post("/v1/completions", {**ok, field: value}, 400, field)
    post("/v1/completions", {"prompt": [1] * 600}, 400, "prompt", "maximum context length is 512")
    post("/v1/completions", {"prompt": "Lily", "max_tokens": 600}, 400, "max_tokens", "maximum context length")
    post("/v1/completions", {"prompt": [[1, 2], "x"]}, 400, "prompt")
    post("/v1/completions", {"prompt": [5000]}, 400, "prompt", "outside the vocabulary")
    post("/v1/chat/completions", {"messages": "hi"}, 400, "messages")
    post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
         "top_logprobs")
    post("/v1/completions", {**ok, "model": "gpt-4"}, 404, "model", "does not exist")
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="top_p"):
        server.client.completions.create(model="stories", prompt="x", top_p=3)
    assert httpx.get(f"{server.url}/v1/nowhere", timeout=10).status_code == 404
    assert httpx.get(f"{server.url}/v1/completions", timeout=10).status_code == 405
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    r = server.client.completions.create(model="stories", prompt="Once upon a time", max_tokens=40, temperature=0)
    assert r.choices[0].text == REFERENCE_TEXT
    assert server.metric("requests_rejected_total") >= 20


def raw_http(url: str, data: bytes, wait: float = 10, then_close: bool = False) -> tuple[bytes, float]:
    """Sends `data` on a fresh connection and reads until the server closes it (or `wait` seconds): (what came, the
    seconds it took). `then_close`: close at once after sending (a client that leaves)."""
    host, port = url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        s.sendall(data)
        if then_close:
            return b"", time.monotonic() - t0
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except (socket.timeout, ConnectionResetError):
            pass
    return got, time.monotonic() - t0


def json_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


@pytest.mark.alone
def test_every_reproduction_is_a_json_4xx_within_a_second(server):
    """The requests that once answered 500 in plain text (or hung): a 4xx in OpenAI's shape, naming the field, within
    a second each; the 50 MB body a 413 from its Content-Length, before it is read. The server serves on."""
    deep = b"[" * 100_000 + b"]" * 100_000
    chat = [{"role": "user", "content": "hi"}]
    cases = [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 4}', "prompt"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", '
                                 b'"content": "\\udc00"}], "echo": true}', "messages"),
        ("/tokenize", b'{"prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', "model"),
        ("/v1/completions", b'{"prompt": ' + deep + b"}", None),
        ("/v1/completions", b'{"prompt": "x", "unknown": ' + deep + b"}", None),
        *[("/v1/chat/completions", json.dumps({"messages": chat, "chat_template_kwargs": {k: 1}}).encode(),
           "chat_template_kwargs") for k in ("messages", "add_generation_prompt", "self")],
        ("/tokenize", json.dumps({"messages": chat, "chat_template_kwargs": {"messages": 1}}).encode(),
         "chat_template_kwargs"),
        ("/v1/completions", b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", "temperature"),
        ("/v1/completions", json.dumps({"prompt": [[1, 2, 3]] * 64, "n": 64}).encode(), "n"),
        ("/v1/completions", b'{"prompt": "a\\u0000b"}', "prompt"),
        ("/v1/completions", b'{"prompt": [1, 5000]}', "prompt"),
        ("/v1/completions", json.dumps({"prompt": "Once " * 5000}).encode(), "prompt"),  # (never tokenized)
    ]
    for path, body, param in cases:
        t0 = time.monotonic()
        r = httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=10)
        took = time.monotonic() - t0
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == 400 and err["param"] == param and err["message"], (path, r.text)
        assert "\n" not in err["message"] and took < 1.0, (path, took)
    big = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " + \
        str(50 * 10 ** 6).encode() + b"\r\n\r\n" + b'{"prompt": "' + b"a" * 300_000
    raw, took = raw_http(server.url, big)
    status, err = json_error(raw)
    assert status == 413 and "--max_request_bytes" in err["message"] and took < 1.0, (raw[:300], took)
    r = server.client.completions.create(model="stories", prompt="Once upon a time", max_tokens=40, temperature=0)
    assert r.choices[0].text == REFERENCE_TEXT


def test_the_server_outlives_every_admitted_sampling_value(server):
    """temperature 1e-300 (which once stopped the server) and the other extremes of what the request models admit:
    each answered 200 with its tokens, streamed or not; then the reference text as ever."""
    extremes = [dict(temperature=1e-300), dict(temperature=5e-324), dict(temperature=1e300), dict(top_p=5e-324),
                dict(min_p=1.0), dict(min_p=1e-300), dict(top_k=2 ** 31 - 1), dict(top_k=1),
                dict(presence_penalty=2, frequency_penalty=-2), dict(presence_penalty=-2, frequency_penalty=2),
                dict(repetition_penalty=5e-324), dict(repetition_penalty=1.7e308),
                dict(logit_bias={str(i): 100 for i in range(0, 512, 7)}),
                dict(logit_bias={str(i): -100 for i in range(512)}),
                dict(temperature=0, repetition_penalty=1e-300, logit_bias={"5": -100})]
    for i, extra in enumerate(extremes):
        body = {"model": "stories", "prompt": "Once", "max_tokens": 4, "seed": i, "ignore_eos": True, **extra}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, (extra, r.text)
        streamed = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30).text
        assert streamed.endswith("data: [DONE]\n\n") and '"error"' not in streamed, (extra, streamed[-300:])
    r = server.client.completions.create(model="stories", prompt="Once upon a time", max_tokens=40, temperature=0)
    assert r.choices[0].text == REFERENCE_TEXT


@pytest.mark.alone
def test_slow_and_vanishing_clients(server):
    """A client that trickles its headers, or its body, is answered 408 and dropped after --header_timeout /
    --body_timeout (1 s here); one that leaves mid-body or mid-stream is one log line, no traceback; past
    --max_connections (48) a connection is answered 503 (JSON, Retry-After) and closed; the server serves on."""
    before = server.job.stderr.count("went away")
    raw, took = raw_http(server.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    status, err = json_error(raw)
    assert status == 408 and "headers" in err["message"] and 0.9 < took < 5, (raw, took)
    raw, took = raw_http(server.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    status, err = json_error(raw)
    assert status == 408 and "body" in err["message"] and 0.9 < took < 5, (raw, took)
    raw_http(server.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{", then_close=True)
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30, json={
            "model": "stories", "prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
        next(r.iter_bytes())
    idle = [socket.create_connection(server.url.removeprefix("http://").split(":")) for _ in range(48)]
    try:
        time.sleep(0.2)
        raw, _ = raw_http(server.url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, err = json_error(raw)
        assert status == 503 and b"retry-after: 1" in raw.lower() and "--max_connections" in err["message"]
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10
    while server.job.stderr.count("went away") < before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    log = server.job.stderr
    assert log.count("went away") == before + 2 and "Traceback" not in log and "Exception in ASGI" not in log, log[-3000:]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_fuzzed_requests_get_no_5xx(server):
    """schemathesis against /openapi.json, bounded: requests that follow the schema and requests that break it, on
    every endpoint; none is answered 5xx, every refusal is JSON in OpenAI's shape."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    doc = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    ops = [r.ok() for r in schemathesis.openapi.from_dict(doc).get_all_operations()]
    assert {(o.method, o.path) for o in ops} >= {("post", "/v1/completions"), ("post", "/v1/chat/completions"),
                                                 ("post", "/tokenize"), ("post", "/detokenize")}
    seen = {}
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        for op in [o for o in ops if mode == GenerationMode.POSITIVE or o.method == "post"]:
            @settings(max_examples=12 if op.method == "post" else 1, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def call(case):
                r = case.call(base_url=server.url, timeout=60)
                seen[r.status_code] = seen.get(r.status_code, 0) + 1
                assert r.status_code < 500, (case.as_curl_command(), r.text)
                if r.status_code >= 400:
                    assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text

            call()
    assert seen.get(400, 0) > 20 and seen.get(200, 0) > 3, seen


# -- mpirun -np 2 -------------------------------------------------------------------------------
def test_tp2_reference_text_and_no_chat_template(tp2_server):
    c = tp2_server.client
    r = c.completions.create(model=tp2_server.model, prompt="Once upon a time", max_tokens=40, temperature=0)
    assert r.choices[0].text == REFERENCE_TEXT
    with pytest.raises(openai.BadRequestError, match="has no chat template"):
        c.chat.completions.create(model=tp2_server.model, messages=[{"role": "user", "content": "hi"}])


def test_tp2_an_idle_server_keeps_no_core_busy(tp2_server):
    """Between requests the ranks wait for rank 0's next step without spinning (MPICH's blocking broadcast polled a
    core at 100% on every rank but 0 for as long as the server idled): the job's processes, 2 s idle, take under a
    tenth of a core; then a request is served as before."""
    def cpu_seconds() -> float:  # user + system time of every live process of the job
        ticks = sum(int(f[11]) + int(f[12]) for f in map(proc_stat, tp2_server.job.pids()) if len(f) > 12)
        return ticks / os.sysconf("SC_CLK_TCK")

    tp2_server.client.completions.create(model=tp2_server.model, prompt="Once", max_tokens=2)
    time.sleep(1.5)  # (the heartbeats and the last step's statistics settle)
    before, t0 = cpu_seconds(), time.monotonic()
    time.sleep(2.0)
    used = (cpu_seconds() - before) / (time.monotonic() - t0)
    assert used < 0.1, f"{used:.2f} cores busy while idle"
    r = tp2_server.client.completions.create(model=tp2_server.model, prompt="Once upon a time", max_tokens=40,
                                             temperature=0)
    assert r.choices[0].text == REFERENCE_TEXT


def test_tp2_preemption_every_request_completes_correctly(tp2_server, offline):
    """4 sequences of ~145 tokens (2 pages each) at once in a 2-page cache: they are preempted and recomputed,
    and each still ends with the greedy tokens of the offline API. The 4 prompts come in one request, so they are
    queued together: as 4 requests, on a loaded machine the first could finish (0.3 s) before the others arrived,
    and nothing was preempted."""
    prompts = ["Once upon a time", "Lily", "The cat", "A big dog"]
    want = offline.generate(prompts, SamplingParams(max_tokens=140, temperature=0, ignore_eos=True))
    before = tp2_server.metric("preemptions_total")
    got = tp2_server.client.completions.create(model=tp2_server.model, prompt=prompts, max_tokens=140, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [w.outputs[0].text for w in want]
    assert tp2_server.metric("preemptions_total") > before
    assert tp2_server.metric("kv_pages_used") == 0


def test_tp2_full_queue_gets_503_with_retry_after(tp2_server):
    async def one(client, i):
        return await client.post(f"{tp2_server.url}/v1/completions",
                                 json={"prompt": "Lily", "max_tokens": 60, "temperature": 0, "seed": i})

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(16))), 300)

    got = asyncio.run(main())
    busy = [r for r in got if r.status_code == 503]
    done = [r for r in got if r.status_code == 200]
    assert busy and done and len(busy) + len(done) == 16
    assert all(r.headers.get("retry-after") and "busy" in r.json()["error"]["message"] for r in busy)
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in done)


def test_tp2_port_in_use_fails_cleanly(tp2_server, tmp_path):
    port = tp2_server.url.rsplit(":", 1)[1]
    cmd, env = launch_cmd("mpich", 2, sys.executable, "-m", "runner", "serve", "--ckpt_dir",
                          tp2_server.job.stderr.split("serving ")[1].split(" at ")[0], "--port", port)
    with Job(cmd, tmp_path, {**env, "OMP_NUM_THREADS": "1"}) as job:
        assert job.wait(120) == 2
        assert f"error: cannot serve on 127.0.0.1:{port}" in job.stderr and not job.lingering()


@pytest.mark.alone
def test_tp2_sigterm_drains_then_cancels_and_every_rank_exits(tp2_server):
    """SIGTERM with 6 long streams running or queued: the server drains for --drain_timeout, cancels the rest
    (their streams end with an error event), and every rank exits 0. The drain is 0.1 s: the 1500 tokens, with
    preemptions in a 2-page cache, took 0.65 s after the first chunk at the one-call decode step's speed, so 0.5 s
    let them all finish."""
    first = asyncio.Event()

    async def one(client, i):
        reason = None
        try:  # (a request cancelled before its first token is a 503; one cancelled mid-stream, an error event)
            stream = await client.completions.create(model=tp2_server.model, prompt="Lily", max_tokens=250, seed=i,
                                                     stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                first.set()
                reason = chunk.choices[0].finish_reason or reason
        except openai.APIError as e:
            assert "shutting down" in str(e)
            return "cancelled"
        return reason

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{tp2_server.url}/v1", api_key="none", max_retries=0,
                                      timeout=120) as client:
            tasks = [asyncio.ensure_future(one(client, i)) for i in range(6)]
            await asyncio.wait_for(first.wait(), 60)
            tp2_server.job.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            ends = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return ends, time.monotonic() - t0

    ends, took = asyncio.run(main())
    assert "cancelled" in ends and set(ends) <= {"cancelled", "length"}
    assert took < 10
    rc = tp2_server.job.wait(30)
    assert rc == 0 and not tp2_server.job.lingering(), tp2_server.job.stderr[-3000:]
    assert "server stopped" in tp2_server.job.stderr
