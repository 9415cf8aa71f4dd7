"""`python -m runner serve` / `scripts/Server.py`: the OpenAI-compatible server over 1 or N ranks.

Rank 0 serves HTTP (uvicorn, in a thread) and runs the engine loop on its main thread: requests come
in through a queue, every step goes to all ranks (`runner.serve.engine`), new text goes back to the
handlers' event loop. Ranks 1..N-1 only run the steps. SIGTERM (or SIGINT) on rank 0 stops new
requests (503), lets the running ones finish for up to --drain_timeout seconds, cancels the rest,
tells the other ranks to stop, and exits 0; the other ranks ignore the signal and wait for rank 0's
word (leaving on their own if it has not come --drain_timeout + 10 s later).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
import traceback
from typing import Optional

from runner.errors import PmxError


def serve(ckpt_dir: str, tokenizer_path: Optional[str] = None, host: str = "127.0.0.1", port: int = 8000,
          served_model_name: Optional[str] = None, max_batch: int = 64, kv_cache_tokens: Optional[int] = None,
          max_num_batched_tokens: int = 512, max_waiting: int = 256, gpu_memory_utilization: float = 0.9,
          drain_timeout: float = 5.0, device: str = "auto", dtype: str = "auto", kernels: str = "auto",
          compile: str = "auto", quantized_cache: bool = False, cache_layout: int = 0, cuda_graphs: bool = True,
          fused_decode: bool = True) -> None:
    """Serve a PMX model over OpenAI's HTTP API (completions, chat completions, streaming) on 1 or N ranks.

    Args:
        ckpt_dir: PMX directory split into as many shards as ranks are started (mpirun -np N / torchrun).
        tokenizer_path: tokenizer.model / tokenizer.json or their directory (default: ckpt_dir); its
            tokenizer_config.json gives the chat template.
        host: address to listen on (rank 0).
        port: port to listen on; 0 picks a free one (the address is printed).
        served_model_name: the model's name in the API (default: ckpt_dir as given).
        max_batch: sequences in one step at most.
        kv_cache_tokens: KV-cache budget in tokens, in pages of 128 (default: on GPU --gpu_memory_utilization
            of the memory, on CPU enough for max_batch full-length sequences within a quarter of the free memory).
        max_num_batched_tokens: tokens in one step at most; longer prompts are prefilled in chunks.
        max_waiting: sequences waiting for admission at most; beyond, requests get 503 with Retry-After.
        gpu_memory_utilization: on CUDA, the share of the device memory weights and cache may use.
        drain_timeout: on SIGTERM, seconds the running requests get to finish before they are cancelled.
        device: auto, cpu or cuda.
        dtype: auto, float32, float16 or bfloat16.
        kernels: auto, triton, torch or reference.
        compile: torch.compile the decode step (where --fused_decode does not run it): auto, on or off.
        quantized_cache: int8 KV cache.
        cache_layout: 0..3.
        cuda_graphs: on CUDA with the Triton kernels, replay the decode steps from CUDA graphs (true/false).
        fused_decode: on CPU (float32), run each decode step as one C++ call (true/false).
    """
    from runner.serve.params import is_int, is_number
    if not (is_int(port) and 0 <= port <= 65535):
        raise PmxError(f"--port must be an integer in [0, 65535], got {port!r}")
    if not (is_int(max_waiting) and max_waiting >= 1):
        raise PmxError(f"--max_waiting must be an integer >= 1, got {max_waiting!r}")
    if not (is_number(drain_timeout) and drain_timeout >= 0):
        raise PmxError(f"--drain_timeout must be a number >= 0, got {drain_timeout!r}")
    from runner.serve.api import ApiContext, build_app
    from runner.serve.async_engine import AsyncEngine
    from runner.serve.loader import EngineArgs, load
    from runner.serve.metrics import Metrics

    args = EngineArgs(tokenizer_path, max_batch, max_num_batched_tokens, kv_cache_tokens, gpu_memory_utilization,
                      device, dtype, kernels, compile, quantized_cache, cache_layout, cuda_graphs, fused_decode)
    metrics = Metrics()
    loaded = load(ckpt_dir, args, metrics)
    sess, engine = loaded.session, loaded.engine
    if not sess.is_main:
        _follow(engine, drain_timeout)
        sess.close()
        return
    client = AsyncEngine(engine, max_waiting, drain_timeout, metrics)
    _drain_on_signals(client.stop)
    name = served_model_name or ckpt_dir
    ctx = ApiContext(client, loaded.tokenizer, loaded.chat_template, name, engine.max_model_len, metrics,
                     int(time.time()))
    try:
        http, thread = _start_http(build_app(ctx), host, port)
    except PmxError as e:
        _leave(sess, engine, f"error: {e}", 2)
    failed = False
    try:
        bound = http.servers[0].sockets[0].getsockname()
        print(f"serving {name} at http://{bound[0]}:{bound[1]} ({sess.env.world_size} rank(s), {sess.device}; "
              f"KV cache {engine.num_pages} pages x 128 = {engine.num_pages * 128} tokens, max batch {max_batch})",
              file=sys.stderr, flush=True)
        client.run()
    except Exception:  # noqa: BLE001 - a bug in the loop: the other ranks are stopped, then this one
        traceback.print_exc()
        failed = True
    finally:
        client.accepting = False
        http.should_exit = True
        thread.join(timeout=drain_timeout + 5)
    _leave(sess, engine, "error: the engine loop failed (see above); server stopped" if failed else "server stopped",
           1 if failed else 0)


def _drain_on_signals(handler) -> None:
    """SIGTERM / SIGINT call `handler` (a graceful drain) instead of taking the job's error path: the job's
    signal watcher (runner.parallel.job), which would end the job a grace second later, is no longer woken."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def _leave(sess, engine, message: str, status: int) -> None:
    """Rank 0: tells the other ranks to stop, closes the session with them, prints `message`; exits with
    `status` when non-zero. (Past this point the other ranks are gone, so no error may take a path that
    needs them.)"""
    engine.channel.send({"k": "stop"})
    sess.close()
    print(message, file=sys.stderr, flush=True)
    if status:
        raise SystemExit(status)


def _start_http(app, host: str, port: int):
    import uvicorn
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=2)
    http = uvicorn.Server(config)
    thread = threading.Thread(target=http.run, name="pmx-http", daemon=True)
    thread.start()
    while not http.started:
        if not thread.is_alive():
            raise PmxError(f"cannot serve on {host}:{port} (see the message above)")
        time.sleep(0.05)
    return http, thread


def _follow(engine, drain_timeout: float) -> None:
    """Ranks 1..N-1: run rank 0's steps until it says stop."""
    term = {}

    def on_signal(*_):
        term.setdefault("at", time.monotonic())

    _drain_on_signals(on_signal)
    msg = engine.follow(lambda: "at" in term and time.monotonic() - term["at"] > drain_timeout + 10)
    if msg["k"] not in ("stop", "quit"):
        raise PmxError(f"unexpected message from rank 0: {msg['k']!r}")
