"""Rank 0's bridge between the HTTP handlers (uvicorn's thread) and the engine loop (the main thread).

The handlers check a request and put it into a queue; the loop takes what came in between two steps as that
step's events (sent to every rank with the step), runs the steps (heartbeats when idle), and hands each step's
new text to the handlers' event loop.
"""

from __future__ import annotations

import queue
import time
from typing import Optional

from runner.serve.api import ApiError, Subscription
from runner.serve.engine import HEARTBEAT_S, Delta, LLMEngine
from runner.serve.metrics import Metrics


class AsyncEngine:
    """Rank 0: the engine loop (main thread) and the doors the HTTP handlers use (their thread)."""

    def __init__(self, engine: LLMEngine, max_waiting: int, drain_timeout: float, metrics: Metrics):
        self.engine, self.max_waiting, self.drain_timeout, self.metrics = engine, max_waiting, drain_timeout, metrics
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.routes: dict[str, Subscription] = {}   # engine thread only
        self.accepting = True
        self.stop_at: Optional[float] = None

    # -- HTTP thread ---------------------------------------------------------------------------------
    def check(self, prompt_ids: list, params) -> int:
        return self.engine.check(prompt_ids, params)

    def submit(self, request_ids: list, prompts: list, params) -> Subscription:
        if not self.accepting:
            raise ApiError(503, "the server is shutting down", headers={"Retry-After": "5"})
        queued = self.inbox.qsize() + self.engine.num_waiting()
        if queued + len(prompts) * params.n > self.max_waiting:
            raise ApiError(503, f"the server is busy: {queued} sequences are waiting (--max_waiting "
                                f"{self.max_waiting}); retry later", headers={"Retry-After": "1"})
        sub = Subscription(self, request_ids)
        arrival = time.monotonic()
        for rid, ids in zip(request_ids, prompts):
            self.inbox.put(("add", rid, ids, params, sub, arrival))
        return sub

    def cancel(self, request_ids: list) -> None:
        for rid in request_ids:
            self.inbox.put(("cancel", rid))

    # -- engine thread -------------------------------------------------------------------------------
    def stop(self, *_) -> None:
        """Signal handler: drain, then stop."""
        if self.stop_at is None:
            self.stop_at = time.monotonic()
            self.accepting = False

    def run(self) -> None:
        """Steps until stopped and drained."""
        eng = self.engine
        while True:
            events = []
            while True:
                try:
                    events += self._event(self.inbox.get_nowait())
                except queue.Empty:
                    break
            if self.stop_at is not None and (not (eng.has_work() or events) or
                                             time.monotonic() > self.stop_at + self.drain_timeout):
                self._publish(eng.cancel_all())
                return
            if not (eng.has_work() or events):
                try:
                    events += self._event(self.inbox.get(timeout=HEARTBEAT_S))
                except queue.Empty:
                    eng.heartbeat()
                    continue
            self._publish(eng.step_with(events))

    def _event(self, item: tuple) -> list:
        """The step event of an inbox item (none for a request that came in as the drain began)."""
        if item[0] == "add":
            _, rid, ids, params, sub, arrival = item
            if not self.accepting:
                sub.deliver([Delta(rid, 0, "", [], [], "abort", usage=(len(ids), 0))])
                return []
            self.routes[rid] = sub
            return [("add", rid, ids, params, arrival)]
        return [("cancel", item[1])]

    def _publish(self, deltas: list) -> None:
        by_sub: dict[int, tuple] = {}
        for d in deltas:
            sub = self.routes.get(d.request_id)
            if sub is None:
                continue
            by_sub.setdefault(id(sub), (sub, []))[1].append(d)
            if d.usage is not None:
                del self.routes[d.request_id]
        if by_sub:
            Subscription.deliver_all(list(by_sub.values()))
