"""Rank 0's engine loop: the requests of the server's front end (a process of its own, runner.serve.frontend) in,
token deltas out, over a channel (runner.serve.channel); nothing else runs in this process, so no HTTP work ever
waits on a step and no step waits on HTTP work.

Each round takes what the front end sent since the last (adds are checked here, where the queue is known: one that
can never run is a 400, one that cannot run now a 503), sends the round's events to every rank with the step
(runner.serve.engine), runs the step and sends its token deltas back. While idle it waits on the channel, sending the
other ranks a heartbeat every HEARTBEAT_S. SIGTERM / SIGINT (:meth:`EngineLoop.stop`) start a drain: the front end is
told to refuse new requests, the running ones get --drain_timeout seconds, the rest are cancelled, and the front end
is told to stop.
"""

from __future__ import annotations

import socket
import time
import traceback
from typing import Optional

from runner.serve.channel import EngineEnd
from runner.serve.engine import HEARTBEAT_S, LLMEngine
from runner.serve.metrics import STATS_PERIOD_S, EngineStats
from runner.serve.params import ParamError, SamplingParams


class EngineLoop:
    """Rank 0: the engine loop over the channel `sock` to the front end."""

    def __init__(self, engine: LLMEngine, sock: socket.socket, max_waiting: int, drain_timeout: float,
                 stats: Optional[EngineStats] = None):
        self.engine, self.max_waiting, self.drain_timeout, self.stats = engine, max_waiting, drain_timeout, stats
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self.channel = EngineEnd(sock, self._wake_r)
        self.accepting = True
        self.stop_at: Optional[float] = None
        self._stats_at = 0.0

    def stop(self, *_) -> None:
        """Signal handler: drain, then stop (the loop wakes at once)."""
        if self.stop_at is None:
            self.stop_at = time.monotonic()
            self.accepting = False
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    def close(self) -> None:
        for s in (self._wake_r, self._wake_w):
            s.close()

    def run(self) -> None:
        """Rounds until stopped and drained; ChannelClosed if the front end goes away."""
        eng, told_drain = self.engine, False
        heard = time.monotonic()  # the other ranks last heard from rank 0
        while True:
            idle = not eng.has_work()
            wait = max(0.0, HEARTBEAT_S - (time.monotonic() - heard)) if idle and self.stop_at is None else 0.0
            errors, events = [], []
            for msg in self.channel.receive(wait):
                self._take(msg, events, errors)
            if self.stop_at is not None and not told_drain:
                self.channel.send(("drain",))
                told_drain = True
            if self.stop_at is not None and (not (eng.has_work() or events) or
                                             time.monotonic() > self.stop_at + self.drain_timeout):
                self._send(errors, eng.apply([e for e in events if e[0] == "cancel"]) + eng.cancel_all(), force=True)
                self.channel.send(("stop",))
                self.channel.flush()
                return
            if not (eng.has_work() or events):
                if errors:
                    self._send(errors, [])
                if time.monotonic() - heard >= HEARTBEAT_S:
                    eng.heartbeat()
                    heard = time.monotonic()
                continue
            deltas = eng.step_with(events)
            heard = time.monotonic()
            # (the stats go with every round that admitted, cancelled or finished a request: /metrics agrees with what
            # a client has seen, whatever the period)
            self._send(errors, deltas, force=bool(events) or not eng.has_work() or any(d.done for d in deltas))

    def _take(self, msg: list, events: list, errors: list) -> None:
        """A message of the front end into this round's events, or an error for it."""
        if msg[0] == "cancel":
            events.append(("cancel", msg[1], msg[2]))
            return
        _, rid, ids, fields = msg
        try:
            params = SamplingParams(**fields)
            if not self.accepting:
                errors.append((rid, 503, "the server is shutting down", None))
                return
            self.engine.check(ids, params)
        except ParamError as e:
            errors.append((rid, 400, str(e), e.param))
            return
        except Exception as e:  # noqa: BLE001 - a request's failure is its own
            traceback.print_exc()
            errors.append((rid, 500, f"the request could not be checked: {type(e).__name__}: {e}", None))
            return
        queued = self.engine.num_waiting() + sum(ev[3].n for ev in events if ev[0] == "add")
        if queued + params.n > self.max_waiting:
            errors.append((rid, 503, f"the server is busy: {queued} sequences are waiting (--max_waiting "
                                     f"{self.max_waiting}); retry later", None))
            return
        events.append(("add", rid, ids, params))

    def _send(self, errors: list, deltas: list, force: bool = False) -> None:
        """A round's answer: the refused adds, the token deltas, and the engine's stats when STATS_PERIOD_S has
        passed since the last (or `force`: the requests changed, or the engine went idle)."""
        now = time.monotonic()
        stats = None
        if self.stats is not None and (force or now - self._stats_at >= STATS_PERIOD_S):
            stats, self._stats_at = self.stats.snapshot(), now
        if errors or deltas or stats is not None:
            self.channel.send(("out", errors, [d.wire() for d in deltas], stats))
