"""`python -m runner serve` / `scripts/Server.py`: the OpenAI-compatible server over 1 or N ranks.

Rank 0 runs the engine loop (runner.serve.engine_loop) and starts the HTTP front end, a process of its own
(runner.serve.frontend: HTTP, request models, tokenization, detokenization, metrics), which it talks to over a
channel; each step's new requests and cancels go to all ranks with the step (runner.serve.engine), and ranks
1..N-1 apply the same events and run the same steps. SIGTERM (or SIGINT) on rank 0 stops new requests (503), lets
the running ones finish for up to --drain_timeout seconds, cancels the rest, stops the front end, tells the other
ranks to stop, and exits 0; the front end and the other ranks ignore the signal and wait for rank 0's word (the
other ranks leave on their own if it has not come --drain_timeout + 10 s later; the front end goes with rank 0).
"""

from __future__ import annotations

import signal
import sys
import time
import traceback
from typing import Annotated, Optional

from runner.args import ChatTemplateFile, CkptDir, PositiveInt, Range, TokenizerPath
from runner.config import EngineConfig, serving_config
from runner.errors import PmxError
from runner.serve import frontend
from runner.serve.channel import ChannelClosed
from runner.serve.engine_loop import EngineLoop
from runner.serve.loader import load
from runner.serve.metrics import EngineStats


def serve(ckpt_dir: CkptDir, tokenizer_path: TokenizerPath = None, chat_template: ChatTemplateFile = None,
          host: str = "127.0.0.1", port: Annotated[int, Range(0, 65535)] = 8000,
          served_model_name: Optional[str] = None, max_waiting: PositiveInt = 256,
          drain_timeout: Annotated[float, Range(0)] = 5.0, max_request_bytes: PositiveInt = 4 << 20,
          header_timeout: Annotated[float, Range(0, lo_open=True)] = 10.0,
          body_timeout: Annotated[float, Range(0, lo_open=True)] = 30.0,
          keep_alive_timeout: Annotated[float, Range(1)] = 5.0, max_connections: PositiveInt = 1024,
          random_weights: bool = False, config: EngineConfig = serving_config()) -> None:
    """Serve a PMX model over OpenAI's HTTP API (completions, chat completions, streaming) on 1 or N ranks.

    Args:
        host: address to listen on (rank 0's front end).
        port: port to listen on; 0 picks a free one (the address is printed).
        served_model_name: the model's name in the API (default: ckpt_dir as given).
        max_waiting: sequences waiting for admission at most; beyond, requests get 503 with Retry-After (and a
            request of more sequences than this, 400).
        drain_timeout: on SIGTERM, seconds the running requests get to finish before they are cancelled.
        max_request_bytes: a request body's size at most; a larger one gets 413, before it is read.
        header_timeout: seconds a client has to send a request's line and headers (then 408, connection closed).
        body_timeout: seconds a client has to send a request's body (then 408, connection closed).
        keep_alive_timeout: seconds an idle keep-alive connection stays open.
        max_connections: open connections at most; a connection past them is answered 503 and closed.
        random_weights: random weights in the shapes of ckpt_dir's pmx_params.json (no shard read; its tokenizer
            still is): a server to measure without a checkpoint.
    """
    stats = EngineStats()
    loaded = load(ckpt_dir, tokenizer_path, config, stats, progress=True, chat_template=chat_template,
                  random_weights=random_weights)
    sess, llm = loaded.session, loaded.engine
    if not sess.is_main:
        _follow(llm, drain_timeout)
        sess.close()
        return
    name = served_model_name or ckpt_dir
    tok = loaded.tokenizer
    max_batch = config.max_batch
    front_config = frontend.FrontendConfig(
        host, port, name, str(tok.path), tok.bos_id, tok.eos_id,
        loaded.chat_template.spec() if loaded.chat_template is not None else None, llm.max_model_len,
        llm.vocab_size, max_waiting, max_request_bytes, header_timeout, body_timeout, keep_alive_timeout,
        max_connections, int(time.time()))
    try:
        front = frontend.start(front_config)
    except PmxError as e:
        _leave(sess, llm, f"error: {e}", 2)
    loop = EngineLoop(llm, front.sock, max_waiting, drain_timeout, stats)
    _drain_on_signals(loop.stop)
    failed = None
    try:
        print(f"serving {name} at http://{front.address[0]}:{front.address[1]} ({sess.env.world_size} rank(s), "
              f"{sess.device}; KV cache {llm.core.cache.rows} tokens, max batch {max_batch})", file=sys.stderr,
              flush=True)
        loop.run()
    except ChannelClosed:
        failed = "the HTTP front end exited unexpectedly"
    except Exception:  # noqa: BLE001 - a bug in the loop: the other ranks are stopped, then this one
        traceback.print_exc()
        failed = "the engine loop failed (see above)"
    finally:
        status = front.stop(drain_timeout + 5)
        loop.close()
    if failed and status:
        failed += f" (the front end's exit status {status})"
    _leave(sess, llm, f"error: {failed}; server stopped" if failed else "server stopped", 1 if failed else 0)


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


def _follow(engine, drain_timeout: float) -> None:
    """Ranks 1..N-1: run rank 0's steps until it says stop."""
    term = {}

    def on_signal(*_):
        term.setdefault("at", time.monotonic())

    _drain_on_signals(on_signal)
    msg = engine.follow(lambda: "at" in term and time.monotonic() - term["at"] > drain_timeout + 10)
    if msg["k"] not in ("stop", "quit"):
        raise PmxError(f"unexpected message from rank 0: {msg['k']!r}")
