"""Tensors left where they are stored, moved file to file by the kernel: what makes convert, split and merge run
at the speed of a copy.

A :class:`Stored` tensor is a dtype, a shape and a list of file ranges whose concatenation is the tensor's
C-order bytes (a range without a file reads as zeros: the padding a split adds). Cutting one by rows or putting
parts back together is arithmetic on the ranges, never a read. :func:`write_ranges` then moves the bytes into an
output file: large ranges with `copy_file_range` (the page cache copies itself; `sendfile` where that is
refused), small ones (a column cut gives one range per row) with `writev` straight from a read-only map of the
source region, so no byte passes through memory this process allocated. Reading a tensor into memory
(:meth:`Stored.tensor`) or mapping it (:meth:`Stored.mapped`) is left to the tensors that must be transformed.
"""

from __future__ import annotations

import bisect
import errno
import functools
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from runner.errors import PmxError

Range = tuple  # (path or None for zeros, offset, nbytes)
KERNEL_COPY_MIN_RUN = 64 << 10  # average range size from which copy_file_range beats a writev from a map
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
ZEROS = bytes(1 << 20)
_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.EPERM)


def _elsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def coalesce(ranges: Sequence[Range]) -> list[Range]:
    """Ranges with neighbours that continue each other (same file, next offset; or both zeros) joined."""
    out: list[list] = []
    for path, off, n in ranges:
        if n == 0:
            continue
        if out and out[-1][0] == path and (path is None or out[-1][1] + out[-1][2] == off):
            out[-1][2] += n
        else:
            out.append([path, off, n])
    return [tuple(r) for r in out]


@dataclass(frozen=True)
class Stored:
    """A tensor of `dtype` and `shape` whose C-order bytes are the concatenation of `ranges` ((path, offset, nbytes)
    tuples; path None: zeros)."""

    dtype: torch.dtype
    shape: tuple
    ranges: tuple

    @classmethod
    def of_file(cls, path: Path, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> "Stored":
        return cls(dtype, tuple(shape), ((str(path), offset, _prod(shape) * _elsize(dtype)),))

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.ranges)

    @functools.cached_property
    def _starts(self) -> list[int]:
        starts, pos = [], 0
        for _, _, k in self.ranges:
            starts.append(pos)
            pos += k
        return starts

    def _spans(self, at: int, n: int) -> list[Range]:
        """The ranges holding bytes [at, at + n) of the tensor."""
        if len(self.ranges) == 1:
            path, off, k = self.ranges[0]
            if at + n > k:
                raise AssertionError(f"bytes past the end of a {k}-byte stored tensor")
            return [(path, 0 if path is None else off + at, n)]
        starts = self._starts
        out, i = [], max(bisect.bisect_right(starts, at) - 1, 0)
        while n > 0 and i < len(self.ranges):
            path, off, k = self.ranges[i]
            take = min(k - (at - starts[i]), n)
            if take > 0:
                out.append((path, 0 if path is None else off + at - starts[i], take))
                at, n = at + take, n - take
            i += 1
        if n:
            raise AssertionError(f"bytes past the end of a {self.nbytes}-byte stored tensor")
        return out

    def narrow(self, axis: int, start: int, length: int) -> "Stored":
        """`tensor.narrow(axis, start, length)`, where indices at or past shape[axis] read as zeros (padding)."""
        ax = axis % len(self.shape)
        size = self.shape[ax]
        inner = _prod(self.shape[ax + 1:]) * _elsize(self.dtype)
        real = max(0, min(start + length, size) - start)
        pad = (None, 0, (length - real) * inner)
        outer = range(_prod(self.shape[:ax]))
        if len(self.ranges) == 1 and self.ranges[0][0] is not None:  # one file range: offsets by arithmetic
            path, off, _ = self.ranges[0]
            rows = [(path, off + (o * size + start) * inner, real * inner) for o in outer]
            pieces = rows if length == real else [r for row in rows for r in (row, pad)]
        else:
            pieces = []
            for o in outer:
                pieces += self._spans((o * size + start) * inner, real * inner) if real else []
                pieces += [pad] if length > real else []
        shape = list(self.shape)
        shape[ax] = length
        return Stored(self.dtype, tuple(shape), tuple(coalesce(pieces)))

    @staticmethod
    def cat(parts: Sequence["Stored"], axis: int) -> "Stored":
        """`torch.cat(parts, axis)`."""
        first = parts[0]
        ax = axis % len(first.shape)
        inner = _prod(first.shape[ax + 1:]) * _elsize(first.dtype)
        runs = [p.shape[ax] * inner for p in parts]
        pieces = []
        for o in range(_prod(first.shape[:ax])):
            for p, run in zip(parts, runs):
                pieces += p._spans(o * run, run)
        shape = list(first.shape)
        shape[ax] = sum(p.shape[ax] for p in parts)
        return Stored(first.dtype, tuple(shape), tuple(coalesce(pieces)))

    def read(self, at: int, n: int) -> bytes:
        """Bytes [at, at + n) of the tensor."""
        out = bytearray()
        for path, off, k in self._spans(at, n):
            if path is None:
                out += bytes(k)
                continue
            with open(path, "rb") as f:
                got = os.pread(f.fileno(), k, off)
            if len(got) != k:
                raise PmxError(f"{path}: cut short (expected {k} bytes at offset {off})")
            out += got
        return bytes(out)

    def same_bytes(self, other: "Stored", chunk: int = 4 << 20) -> bool:
        if self.nbytes != other.nbytes:
            return False
        return all(self.read(at, min(chunk, self.nbytes - at)) == other.read(at, min(chunk, self.nbytes - at))
                   for at in range(0, self.nbytes, chunk))

    def tensor(self) -> torch.Tensor:
        """An owned copy in memory."""
        out = torch.empty(self.nbytes, dtype=torch.uint8)
        view, pos = memoryview(out.numpy()), 0
        for path, off, k in self.ranges:
            if path is not None:
                with open(path, "rb") as f:
                    if os.preadv(f.fileno(), [view[pos:pos + k]], off) != k:
                        raise PmxError(f"{path}: cut short (expected {k} bytes at offset {off})")
            else:
                out[pos:pos + k] = 0
            pos += k
        return out.view(self.dtype).reshape(self.shape)

    def mapped(self) -> torch.Tensor:
        """The tensor without copying it: a private map of its file region (pages are shared with the page cache
        until written, which nothing here does), or an owned copy where it is not one range of one file."""
        if len(self.ranges) != 1 or self.ranges[0][0] is None or self.nbytes == 0:
            return self.tensor()
        path, off, n = self.ranges[0]
        base = off - off % mmap.ALLOCATIONGRANULARITY
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), off - base + n, access=mmap.ACCESS_COPY, offset=base)
        t = torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=off - base)  # keeps `mm` alive
        return t.view(self.dtype).reshape(self.shape)


def as_tensor(t) -> torch.Tensor:
    """A tensor for code that computes with the values: a Stored tensor mapped, a tensor as it is."""
    return t.mapped() if isinstance(t, Stored) else t


def _write_all(fd: int, views: list) -> None:
    """writev of every view, IOV_MAX at a time, resumed after a short write."""
    i = 0
    while i < len(views):
        batch = views[i:i + IOV_MAX]
        done = os.writev(fd, batch)
        for v in batch:
            if done >= len(v):
                done -= len(v)
                i += 1
            else:
                views[i] = v[done:]
                break


def write_views(fd: int, views: list) -> None:
    _write_all(fd, [v for v in views if len(v)])


def _zero_views(n: int) -> list:
    z = memoryview(ZEROS)
    return [z[:min(len(ZEROS), n - at)] for at in range(0, n, len(ZEROS))]


def _gather(fd: int, ranges: Sequence[Range]) -> None:
    """Writes `ranges` to `fd` with writev from read-only maps of each source file's region (one copy, page cache
    to page cache, through no memory of this process's own)."""
    spans: dict = {}
    for path, off, n in ranges:
        if path is not None:
            lo, hi = spans.get(path, (off, off + n))
            spans[path] = (min(lo, off), max(hi, off + n))
    maps, views = {}, []
    try:
        for path, (lo, hi) in spans.items():
            base = lo - lo % mmap.ALLOCATIONGRANULARITY
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), hi - base, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                               prot=mmap.PROT_READ, offset=base)
            maps[path] = (mm, memoryview(mm), base)
        for path, off, n in ranges:
            if path is None:
                views += _zero_views(n)
            else:
                _, mv, base = maps[path]
                views.append(mv[off - base: off - base + n])
        _write_all(fd, views)
    finally:
        for v in views:
            v.release()
        views.clear()
        for mm, mv, _ in maps.values():
            mv.release()
            mm.close()


def _kernel_copy(fd: int, ranges: Sequence[Range]) -> bool:
    """Copies `ranges` to `fd` inside the kernel (copy_file_range, else sendfile); False, having written nothing,
    where neither is possible between these files."""
    use_sendfile, first = False, True
    for path, off, n in ranges:
        if path is None:
            _write_all(fd, _zero_views(n))
            continue
        src = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < n:
                try:
                    if use_sendfile:
                        k = os.sendfile(fd, src, off + done, n - done)
                    else:
                        k = os.copy_file_range(src, fd, n - done, off + done)
                except OSError as e:
                    if e.errno not in _NO_KERNEL_COPY or not first:
                        raise
                    if use_sendfile:
                        return False
                    use_sendfile = True
                    continue
                if k == 0:
                    raise PmxError(f"{path}: cut short (expected {n} bytes at offset {off})")
                done += k
                first = False
        finally:
            os.close(src)
    return True


def write_ranges(fd: int, ranges: Sequence[Range], min_run: Optional[int] = None) -> None:
    """Appends the bytes of `ranges` to `fd` (at its position): by kernel copy where the ranges are large on
    average (at least `min_run`, default KERNEL_COPY_MIN_RUN), else by writev from maps."""
    ranges = [r for r in ranges if r[2]]
    if not ranges:
        return
    if min_run is None:
        min_run = KERNEL_COPY_MIN_RUN
    if sum(n for _, _, n in ranges) >= min_run * len(ranges) and _kernel_copy(fd, ranges):
        return
    _gather(fd, ranges)


def tensor_views(t: torch.Tensor, min_row_bytes: int = 256) -> Optional[list]:
    """Memoryviews whose concatenation is `t`'s C-order bytes, without a copy: the whole tensor when contiguous,
    else one per row of a tensor whose last dim is contiguous (a column cut, a permutation of rows); None where
    rows would be shorter than `min_row_bytes` or the last dim is strided."""
    if t.numel() == 0:
        return []
    if t.is_contiguous():
        return [memoryview(t.reshape(-1).view(torch.uint8).numpy())]
    if t.dim() < 2 or t.stride(-1) != 1 or t.shape[-1] * t.element_size() < min_row_bytes:
        return None
    a = t.view(_SAME_SIZE_INT[t.element_size()]).numpy()  # numpy has no bfloat16; the bytes are what matter
    return [memoryview(a[idx]).cast("B") for idx in np.ndindex(a.shape[:-1])]


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Scratch:
    """Memory reused from one tensor to the next for those that must be computed (a permutation, a cast): its pages
    are faulted in once, not once per tensor as a fresh allocation's are."""

    def __init__(self):
        self._bufs: dict[str, torch.Tensor] = {}

    def take(self, key: str, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A tensor of `dtype` and `shape` in buffer `key` (valid until the next `take` of that key)."""
        n = _prod(shape) * _elsize(dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = self._bufs[key] = torch.empty(n, dtype=torch.uint8)
        return buf[:n].view(dtype).view(tuple(shape))
