"""The engine as the front end's handlers see it (runner.serve.frontend): requests go to rank 0's engine loop over the
channel, its token deltas come back, become text here (runner.serve.output) and are handed to each HTTP request's
:class:`Subscription`. Everything runs on the front end's event loop; nothing here waits on the engine but the
subscriptions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict
from typing import AsyncIterator, Optional

from runner.serve.channel import ChannelClosed, FrontEnd
from runner.serve.output import TextProcessor, TokenDelta
from runner.serve.params import SamplingParams

log = logging.getLogger("pmx.serve")


class EngineRefused(Exception):
    """The engine refused a request: an HTTP status, a message and the field it names."""

    def __init__(self, status: int, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class ClientGone(Exception):
    """The HTTP client disconnected."""


class Subscription:
    """The deltas of one HTTP request's engine requests (one per prompt)."""

    def __init__(self, client: "EngineClient", request_ids: list):
        self.client = client
        self.queue: asyncio.Queue = asyncio.Queue()
        self.pending = set(request_ids)

    async def deltas(self, receive) -> AsyncIterator[list]:
        """The deltas as they come until every request finished; EngineRefused if the engine refused one (the others
        are cancelled); ClientGone (and the requests cancelled) if the client disconnects first."""
        watcher = asyncio.ensure_future(_disconnected(receive))
        try:
            while self.pending:
                get = asyncio.ensure_future(self.queue.get())
                done, _ = await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    raise ClientGone()
                item = get.result()
                if isinstance(item, EngineRefused):
                    raise item
                self.pending -= {d.request_id for d in item if d.usage is not None}
                yield item
        finally:
            watcher.cancel()
            if self.pending:
                self.client.cancel(sorted(self.pending))


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EngineClient:
    """The front end's side of the engine: submit / cancel, and the task (:meth:`run`) that reads the engine's
    messages. `accepting` turns False when the engine drains; `stopped` is set when it has stopped (or gone)."""

    def __init__(self, channel: FrontEnd, processor: TextProcessor, metrics=None):
        self.channel, self.out, self.metrics = channel, processor, metrics
        self.subs: dict[str, Subscription] = {}
        self.accepting = True
        self.stopped = asyncio.Event()

    def submit(self, request_ids: list, prompts: list, params: SamplingParams,
               arrival: Optional[float] = None) -> Subscription:
        """Sends the requests (one per prompt) to the engine; their deltas come through the subscription."""
        if not self.accepting:
            raise EngineRefused(503, "the server is shutting down")
        sub = Subscription(self, request_ids)
        fields = asdict(params)
        arrival = time.monotonic() if arrival is None else arrival
        for rid, ids in zip(request_ids, prompts):
            self.subs[rid] = sub
            self.out.add(rid, ids, params, arrival)
            self.channel.send(("add", rid, ids, fields))
        return sub

    def cancel(self, request_ids: list) -> None:
        for rid in request_ids:
            if self.subs.pop(rid, None) is not None:
                self.out.forget(rid)
                try:
                    self.channel.send(("cancel", rid, None))
                except ChannelClosed:
                    pass

    async def run(self) -> None:
        """Reads the engine's messages until it stops or goes away."""
        try:
            while True:
                msg = await self.channel.recv()
                if msg[0] == "out":
                    self._out(*msg[1:])
                elif msg[0] == "drain":
                    self.accepting = False
                elif msg[0] == "stop":
                    break
        except ChannelClosed:
            log.error("the engine (rank 0) is gone; the front end stops")
        finally:
            self.accepting = False
            for sub in set(self.subs.values()):
                sub.queue.put_nowait(EngineRefused(503, "the server is shutting down; the request was cancelled"))
            self.subs.clear()
            self.stopped.set()

    def _out(self, errors: list, wire: list, stats: Optional[dict]) -> None:
        for rid, status, message, param in errors:
            sub = self.subs.pop(rid, None)
            self.out.forget(rid, None)
            if sub is not None:
                sub.queue.put_nowait(EngineRefused(status, message, param))
        if wire:
            deltas, cancels = self.out.process([TokenDelta(*w) for w in wire])
            by_sub: dict[int, tuple] = {}
            for d in deltas:
                sub = self.subs.get(d.request_id)
                if sub is None:
                    continue
                by_sub.setdefault(id(sub), (sub, []))[1].append(d)
                if d.usage is not None:
                    del self.subs[d.request_id]
            for sub, batch in by_sub.values():
                sub.queue.put_nowait(batch)
            for rid, index in cancels:
                self.channel.send(("cancel", rid, index))
        if stats is not None and self.metrics is not None:
            self.metrics.update_engine(stats)
