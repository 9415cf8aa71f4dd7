"""`python -m runner serve` / `scripts/Server.py`: the OpenAI-compatible server over 1 or N ranks.

Rank 0 serves HTTP (uvicorn, in a thread) and runs the engine loop on its main thread: requests come
in through a queue, each step's new requests and cancels go to all ranks with the step (`runner.serve.engine`),
new text goes back to the handlers' event loop. Ranks 1..N-1 apply the same events and run the same steps. SIGTERM (or SIGINT) on rank 0 stops new
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
from typing import Annotated, Optional

import uvicorn

from runner.args import ChatTemplateFile, CkptDir, PositiveInt, Range, TokenizerPath
from runner.config import EngineConfig, serving_config
from runner.errors import PmxError
from runner.serve.api import ApiContext, build_app
from runner.serve.async_engine import AsyncEngine
from runner.serve.loader import load
from runner.serve.metrics import Metrics


def serve(ckpt_dir: CkptDir, tokenizer_path: TokenizerPath = None, chat_template: ChatTemplateFile = None,
          host: str = "127.0.0.1", port: Annotated[int, Range(0, 65535)] = 8000,
          served_model_name: Optional[str] = None, max_waiting: PositiveInt = 256,
          drain_timeout: Annotated[float, Range(0)] = 5.0, config: EngineConfig = serving_config()) -> None:
    """Serve a PMX model over OpenAI's HTTP API (completions, chat completions, streaming) on 1 or N ranks.

    Args:
        host: address to listen on (rank 0).
        port: port to listen on; 0 picks a free one (the address is printed).
        served_model_name: the model's name in the API (default: ckpt_dir as given).
        max_waiting: sequences waiting for admission at most; beyond, requests get 503 with Retry-After.
        drain_timeout: on SIGTERM, seconds the running requests get to finish before they are cancelled.
    """
    metrics = Metrics()
    loaded = load(ckpt_dir, tokenizer_path, config, metrics, progress=True, chat_template=chat_template)
    sess, llm = loaded.session, loaded.engine
    if not sess.is_main:
        _follow(llm, drain_timeout)
        sess.close()
        return
    client = AsyncEngine(llm, max_waiting, drain_timeout, metrics)
    _drain_on_signals(client.stop)
    name = served_model_name or ckpt_dir
    ctx = ApiContext(client, loaded.tokenizer, loaded.chat_template, name, llm.max_model_len, metrics,
                     int(time.time()), llm.core.model.params.vocab_size)
    try:
        http, thread = _start_http(build_app(ctx), host, port)
    except PmxError as e:
        _leave(sess, llm, f"error: {e}", 2)
    failed = False
    try:
        bound = http.servers[0].sockets[0].getsockname()
        print(f"serving {name} at http://{bound[0]}:{bound[1]} ({sess.env.world_size} rank(s), {sess.device}; "
              f"KV cache {llm.core.cache.rows} tokens, max batch {engine.max_batch})", file=sys.stderr, flush=True)
        client.run()
    except Exception:  # noqa: BLE001 - a bug in the loop: the other ranks are stopped, then this one
        traceback.print_exc()
        failed = True
    finally:
        client.accepting = False
        http.should_exit = True
        thread.join(timeout=drain_timeout + 5)
    _leave(sess, llm, "error: the engine loop failed (see above); server stopped" if failed else "server stopped",
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
