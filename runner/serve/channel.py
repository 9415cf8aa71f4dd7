"""The channel between the server's HTTP front end (a process of its own, runner.serve.frontend) and rank 0's engine
loop (runner.serve.engine_loop): MessagePack messages, each after its length, over a Unix socket pair that rank 0
makes and the front end inherits (no file, no port: no other process can reach it; either side sees the other go
as end-of-file).

The engine side never blocks on the front end: its socket is non-blocking and what the kernel does not take yet
waits in a buffer of its own, sent on the loop's next round (:class:`EngineEnd`). The front end reads and writes
through asyncio (:class:`FrontEnd`).

Front end -> engine: ("add", request id, prompt ids, SamplingParams as a dict), ("cancel", request id, completion
index or None). Engine -> front end: ("out", errors, token deltas, engine stats or None) after each round, errors
[(request id, HTTP status, message, param)] of the adds it refused, token deltas as TokenDelta.wire() tuples;
("drain",) when it stops taking requests; ("stop",) when it has stopped.
"""

from __future__ import annotations

import asyncio
import select
import socket
import struct
from typing import Any, Optional

import msgspec

_LENGTH = struct.Struct("<I")
MAX_MESSAGE = 1 << 30


class ChannelClosed(Exception):
    """The other end went away."""


def encode(msg: Any) -> bytes:
    data = msgspec.msgpack.encode(msg)
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"a message of {len(data)} bytes is over the channel's {MAX_MESSAGE}")
    return _LENGTH.pack(len(data)) + data


_decoder = msgspec.msgpack.Decoder()


def decode(data: bytes) -> Any:
    return _decoder.decode(data)


class _Frames:
    """Whole messages out of a byte stream fed in pieces."""

    def __init__(self):
        self.buf = bytearray()

    def feed(self, data: bytes) -> list:
        self.buf += data
        out, at = [], 0
        while len(self.buf) - at >= _LENGTH.size:
            (n,) = _LENGTH.unpack_from(self.buf, at)
            if len(self.buf) - at - _LENGTH.size < n:
                break
            out.append(decode(bytes(self.buf[at + _LENGTH.size: at + _LENGTH.size + n])))
            at += _LENGTH.size + n
        del self.buf[:at]
        return out


def send_blocking(sock: socket.socket, msg: Any) -> None:
    """One message, before either side runs its loop (the front end's configuration, its answer)."""
    sock.sendall(encode(msg))


def recv_blocking(sock: socket.socket, timeout: Optional[float] = None) -> Any:
    """One message, waiting at most `timeout` seconds (socket.timeout past it); ChannelClosed on end-of-file."""
    sock.settimeout(timeout)
    try:
        head = _recv_exactly(sock, _LENGTH.size)
        return decode(_recv_exactly(sock, _LENGTH.unpack(head)[0]))
    finally:
        sock.settimeout(None)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ChannelClosed()
        buf += chunk
    return bytes(buf)


class EngineEnd:
    """Rank 0's end: sends without blocking (what the socket does not take yet is kept and sent later), and waits
    for messages at most a given time, also waking on `wake` (a socket a signal handler writes to)."""

    def __init__(self, sock: socket.socket, wake: Optional[socket.socket] = None):
        self.sock, self.wake = sock, wake
        sock.setblocking(False)
        self.pending = bytearray()
        self.frames = _Frames()

    def send(self, msg: Any) -> None:
        self.pending += encode(msg)
        self.flush()

    def flush(self) -> None:
        while self.pending:
            try:
                n = self.sock.send(self.pending)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # (the front end is gone: EPIPE / ECONNRESET)
                raise ChannelClosed() from e
            del self.pending[:n]

    def receive(self, timeout: float) -> list:
        """The messages that came, waiting up to `timeout` seconds for one (0: none); sends what is pending
        as the socket takes it. ChannelClosed when the front end has gone."""
        readers = [self.sock] + ([self.wake] if self.wake is not None else [])
        ready, writable, _ = select.select(readers, [self.sock] if self.pending else [], [], max(timeout, 0))
        if writable:
            self.flush()
        if self.wake is not None and self.wake in ready:
            try:
                while self.wake.recv(64):
                    pass
            except (BlockingIOError, InterruptedError):
                pass
        out = []
        while True:
            try:
                data = self.sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                return out
            except OSError as e:
                raise ChannelClosed() from e
            if not data:
                raise ChannelClosed()
            out += self.frames.feed(data)


class FrontEnd:
    """The front end's end, on its asyncio loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, sock: socket.socket) -> "FrontEnd":
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 20)
        return cls(reader, writer)

    def send(self, msg: Any) -> None:
        """Queued on the transport at once (asyncio writes it as the socket takes it)."""
        if self.writer.is_closing():
            raise ChannelClosed()
        self.writer.write(encode(msg))

    async def recv(self) -> Any:
        try:
            head = await self.reader.readexactly(_LENGTH.size)
            return decode(await self.reader.readexactly(_LENGTH.unpack(head)[0]))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise ChannelClosed() from e

    def close(self) -> None:
        self.writer.close()
