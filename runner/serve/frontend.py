"""The server's HTTP front end: a process of its own beside rank 0's engine loop (vLLM V1's split), started by
rank 0 (:func:`start`) and talking to it over a channel (runner.serve.channel).

It holds the HTTP server (uvicorn, with the limits below), the request models, the tokenizer and chat template
(tokenization, detokenization, stop strings: runner.serve.output) and the metrics; the engine process holds the
model and nothing else. So HTTP work never waits on a step, a step never waits on HTTP work, and they do not share a
GIL. It needs no torch.

Limits: a body over --max_request_bytes is refused (413) from its Content-Length, before it is read; a client
gets --header_timeout seconds to send a request's line and headers, and --body_timeout for its body (then 408 and
the connection closed); at most --max_connections connections are open (past that a new one is answered 503 and
closed); an idle keep-alive connection is closed after --keep_alive_timeout.

It leaves when rank 0 tells it to (after the drain) or goes away (end-of-file on the channel; and the kernel kills
it if rank 0 dies: PR_SET_PDEATHSIG), and ignores SIGINT / SIGTERM, which rank 0 handles for both.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

from runner.errors import PmxError
from runner.serve.channel import ChannelClosed, recv_blocking, send_blocking

log = logging.getLogger("pmx.serve")

# what a launcher tells its ranks: the front end is no rank, so it gets none of it
_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
              "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_RANK_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "MPI_", "HYDRA_", "MPIR_", "TORCHELASTIC_")
START_TIMEOUT_S = 120


@dataclass
class FrontendConfig:
    """What rank 0 tells the front end when it starts it."""
    host: str
    port: int
    model_name: str
    tokenizer_path: str
    bos_id: Optional[int]
    eos_id: Optional[int]
    chat_template: Optional[list]   # ChatTemplate.spec(), or None
    max_model_len: int
    vocab_size: int
    max_waiting: int
    max_request_bytes: int
    header_timeout: float
    body_timeout: float
    keep_alive_timeout: float
    max_connections: int
    created: int


# -- rank 0's side ----------------------------------------------------------------------------------------------------
class Frontend:
    """Rank 0's handle on the front-end process: its channel socket and the process."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, address: tuple):
        self.proc, self.sock, self.address = proc, sock, address

    def stop(self, timeout: float) -> int:
        """Waits for the process to leave (it was told to, or its channel closes now), then kills it past `timeout`;
        its exit status."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.sock.close()
        try:
            return self.proc.wait(2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.sock.close()


def start(config: FrontendConfig) -> Frontend:
    """Starts the front end and waits until it listens; PmxError (it has left) when it cannot."""
    ours, theirs = socket.socketpair()
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARS and not k.startswith(_RANK_PREFIXES)}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "runner.serve.frontend", str(theirs.fileno()), str(os.getpid())],
                                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
    finally:
        theirs.close()
    try:
        send_blocking(ours, asdict(config))
        reply = recv_blocking(ours, START_TIMEOUT_S)
    except (ChannelClosed, OSError) as e:
        proc.kill()
        proc.wait()
        ours.close()
        raise PmxError(f"the HTTP front end did not start ({type(e).__name__}: see the messages above)") from None
    if reply[0] != "ready":
        proc.wait()
        ours.close()
        raise PmxError(reply[1])
    return Frontend(proc, ours, (reply[1], reply[2]))


# -- the front end's process ------------------------------------------------------------------------------------------
def _die_with(parent: int) -> None:
    """The kernel sends this process SIGKILL when the process that started it ends (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # (it ended before the line above)
        os._exit(1)


def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard == resource.RLIM_INFINITY else min(hard, need),
                                                        hard))


def _listen(host: str, port: int) -> socket.socket:
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(info[4])
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def _canned(status: int, reason: str, message: str, kind: str, headers: str = "") -> bytes:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n{headers}\r\n").encode() + body


def guarded_protocol(header_timeout: float, max_connections: int, metrics) -> type:
    """uvicorn's httptools protocol with a deadline for each request's line and headers (from the connection's
    start, or the request's first byte) and a cap on open connections; both answered in OpenAI's error shape."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    too_slow = _canned(408, "Request Timeout", f"the request's headers did not arrive within {header_timeout:g} s",
                       "timeout_error")
    busy = _canned(503, "Service Unavailable", f"the server has {max_connections} connections open "
                                               f"(--max_connections); retry later", "service_unavailable",
                   "retry-after: 1\r\n")

    class GuardedHttp(HttpToolsProtocol):
        _timer = None
        _refused = False

        def connection_made(self, transport) -> None:
            if len(self.connections) >= max_connections:
                self._refused, self.transport = True, transport
                metrics.responses.labels("503").inc()
                transport.write(busy)
                transport.close()
                return
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        def connection_lost(self, exc) -> None:
            self._disarm()
            if not self._refused:
                super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._timer is None:
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def _arm(self) -> None:
            self._timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _headers_too_slow(self) -> None:
            self._timer = None
            if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
                return
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            log.info("client %s sent no whole request line and headers within %g s: closed", client,
                     header_timeout)
            metrics.responses.labels("408").inc()
            self.transport.write(too_slow)
            self.transport.close()

    return GuardedHttp


async def _serve(cfg: FrontendConfig, sock: socket.socket, listener: socket.socket, tokenizer, template,
                 max_token_bytes: int) -> None:
    import uvicorn

    from runner.serve.api import ApiContext, build_app
    from runner.serve.channel import FrontEnd
    from runner.serve.client import EngineClient
    from runner.serve.metrics import FrontendMetrics
    from runner.serve.output import TextProcessor

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # (rank 0 handles SIGINT / SIGTERM for both processes)
            yield

    channel = await FrontEnd.open(sock)
    metrics = FrontendMetrics()
    client = EngineClient(channel, TextProcessor(tokenizer, metrics), metrics)
    app = build_app(ApiContext(client, tokenizer, template, cfg.model_name, cfg.max_model_len, cfg.vocab_size,
                               cfg.max_waiting, metrics, cfg.created, cfg.max_request_bytes, cfg.body_timeout,
                               max_token_bytes))
    config = uvicorn.Config(app, http=guarded_protocol(cfg.header_timeout, cfg.max_connections, metrics),
                            lifespan="off", log_level="warning", access_log=False,
                            timeout_keep_alive=max(1, round(cfg.keep_alive_timeout)), timeout_graceful_shutdown=2)
    server = Server(config)
    engine = asyncio.ensure_future(client.run())
    http = asyncio.ensure_future(server.serve(sockets=[listener]))
    await asyncio.wait({engine, http}, return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    await http
    engine.cancel()
    channel.close()
    app.api.pool.shutdown(wait=False, cancel_futures=True)


def _longest_token(tokenizer) -> int:
    """The longest token's text in UTF-8 bytes (a byte piece's spelling counted whole: an over-estimate is safe)."""
    return max((len(tokenizer.token_text(i).encode("utf-8", "surrogatepass")) for i in range(tokenizer.size)),
               default=1) or 1


def main(argv: list) -> int:
    fd, parent = int(argv[0]), int(argv[1])
    _die_with(parent)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    sock = socket.socket(fileno=fd)
    cfg = FrontendConfig(**recv_blocking(sock))
    try:
        from runner.engine.tokenizer import Tokenizer
        from runner.serve.chat import ChatTemplate
        tokenizer = Tokenizer(cfg.tokenizer_path, cfg.bos_id, cfg.eos_id)
        template = ChatTemplate(*cfg.chat_template) if cfg.chat_template else None
        _raise_fd_limit(cfg.max_connections + 64)
        try:
            listener = _listen(cfg.host, cfg.port)
        except OSError as e:
            raise PmxError(f"cannot serve on {cfg.host}:{cfg.port} ({e.strerror or e})") from None
    except PmxError as e:
        send_blocking(sock, ("error", str(e)))
        return 2
    host, port = listener.getsockname()[:2]
    send_blocking(sock, ("ready", host, port))
    t0 = time.monotonic()
    max_token_bytes = _longest_token(tokenizer)
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    run(_serve(cfg, sock, listener, tokenizer, template, max_token_bytes))
    log.debug("front end ran %.1f s", time.monotonic() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
