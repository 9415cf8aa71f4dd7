"""Tensors left where they are stored, moved file to file: what makes convert, split and merge run at the speed of
a copy.

A :class:`Stored` tensor is a dtype, a shape and its C-order bytes as a few :class:`Rows` blocks: `count` rows of one
layout, each row the concatenation of the same pieces of files (piece k of row i lies `stride` bytes per row further
on than in row 0; a piece without a file reads as zeros: the padding a split adds). One range of one file is a
block of one row; a column cut of it (a row-parallel weight's shard) is one block of a row per matrix row, and
putting column parts back together is one block whose rows are the parts' rows side by side. Cutting and joining
are arithmetic on the pieces, whatever the number of rows, never a read and never a loop over rows.

:func:`write_stored` then moves the bytes into an output file: runs of at least `KERNEL_COPY_MIN_RUN` bytes on
average with `copy_file_range` (the page cache copies itself; `sendfile` where that is refused), short rows (a
column cut or join: a few KiB a row) gathered a block of rows at a time: the source rows read with one `pread`
(gaps included) into a reused buffer, copied strided into a second one, written with one `write` per block, so
memory stays at the two buffers (a few MiB). Reading a tensor into memory (:meth:`Stored.tensor`) or mapping it
(:meth:`Stored.mapped`) is left to the tensors that must be transformed.
"""

from __future__ import annotations

import bisect
import errno
import functools
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from runner.errors import PmxError

KERNEL_COPY_MIN_RUN = 64 << 10  # average piece size from which copy_file_range beats a gather through a buffer
GATHER_BYTES = 1 << 20  # output bytes gathered per write (rows of a column cut / join); fits in a core's L2
SOURCE_BYTES = 4 << 20  # source bytes read at a time for them (their rows and the gaps between)
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
ZEROS = bytes(1 << 20)
_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.EPERM)

Piece = tuple  # (path or None for zeros, offset in row 0, nbytes, stride: bytes from one row's piece to the next's)


def _elsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


@dataclass(frozen=True)
class Rows:
    """`count` rows, each the concatenation of `pieces`: (path or None for zeros, offset, nbytes, stride) each,
    whose bytes in row i are `nbytes` at `offset + i * stride` of `path`."""

    count: int
    pieces: tuple

    @property
    def row_bytes(self) -> int:
        return sum(p[2] for p in self.pieces)

    @property
    def nbytes(self) -> int:
        return self.count * self.row_bytes

    def window(self, at: int, n: int) -> list["Rows"]:
        """Bytes [at, at + n) of the block: a partial first row, the whole rows between, a partial last row."""
        size = self.row_bytes
        r0, a = divmod(at, size)
        r1, e = divmod(at + n, size)
        if r0 == r1:
            return [Rows(1, _columns(self.pieces, r0, a, e))]
        out = []
        if a:
            out.append(Rows(1, _columns(self.pieces, r0, a, size)))
            r0 += 1
        if r1 > r0:
            out.append(Rows(r1 - r0, _columns(self.pieces, r0, 0, size)))
        if e:
            out.append(Rows(1, _columns(self.pieces, r1, 0, e)))
        return out


def _columns(pieces: Sequence[Piece], row: int, a: int, e: int) -> tuple:
    """Bytes [a, e) of each row of `pieces`, counting rows from `row` (pieces keep their strides)."""
    out, pos = [], 0
    for path, off, n, stride in pieces:
        lo, hi = max(a, pos), min(e, pos + n)
        if lo < hi:
            out.append((path, 0 if path is None else off + row * stride + lo - pos, hi - lo, stride))
        pos += n
    return tuple(out)


def _joined(pieces: Iterable[Piece], one_row: bool) -> list[list]:
    """Pieces with neighbours that continue each other (same file, next offset, same stride; or both zeros)
    joined, empty ones dropped; strides (meaningless in `one_row` blocks) and zeros' offsets set to 0."""
    out: list[list] = []
    for path, off, n, stride in pieces:
        if n == 0:
            continue
        if path is None:
            off, stride = 0, 0
        elif one_row:
            stride = 0
        last = out[-1] if out else None
        if last and last[0] == path and last[3] == stride and (path is None or last[1] + last[2] == off):
            last[2] += n
        else:
            out.append([path, off, n, stride])
    return out


def _normal(blocks: Iterable[Rows]) -> tuple:
    """`blocks` in their one normal form: empty ones dropped, a block of rows that follow each other in one file
    (or are all zeros) made one row, neighbouring one-row blocks made one, continuing pieces joined."""
    out: list[Rows] = []
    for b in blocks:
        pieces = _joined(b.pieces, b.count == 1) if b.count else []
        if not pieces:
            continue
        count = b.count
        if count > 1 and len(pieces) == 1 and (pieces[0][0] is None or pieces[0][3] == pieces[0][2]):
            pieces = [[pieces[0][0], pieces[0][1], pieces[0][2] * count, 0]]
            count = 1
        if count == 1 and out and out[-1].count == 1:
            pieces = _joined(list(out.pop().pieces) + [tuple(p) for p in pieces], True)
        out.append(Rows(count, tuple(tuple(p) for p in pieces)))
    return tuple(out)


@dataclass(frozen=True)
class Stored:
    """A tensor of `dtype` and `shape` whose C-order bytes are those of `blocks` (:class:`Rows`), one after
    the other, in the normal form :func:`_normal` gives."""

    dtype: torch.dtype
    shape: tuple
    blocks: tuple

    @classmethod
    def of_file(cls, path: Path, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> "Stored":
        return cls(dtype, tuple(shape), _normal([Rows(1, ((str(path), offset, _prod(shape) * _elsize(dtype), 0),))]))

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    @functools.cached_property
    def _starts(self) -> list[int]:
        starts, pos = [], 0
        for b in self.blocks:
            starts.append(pos)
            pos += b.nbytes
        return starts

    def _window(self, at: int, n: int) -> list[Rows]:
        """Blocks holding bytes [at, at + n) of the tensor."""
        out, i = [], max(bisect.bisect_right(self._starts, at) - 1, 0)
        while n > 0:
            if i >= len(self.blocks):
                raise AssertionError(f"bytes past the end of a {self.nbytes}-byte stored tensor")
            b = self.blocks[i]
            take = min(b.nbytes - (at - self._starts[i]), n)
            if take > 0:
                out += b.window(at - self._starts[i], take)
                at, n = at + take, n - take
            i += 1
        return out

    def _as_rows(self, count: int) -> Optional[Rows]:
        """The tensor as one block of `count` equal rows, where its blocks give one without a loop over rows."""
        if len(self.blocks) != 1:
            return None
        b = self.blocks[0]
        if b.count == count:
            return b
        if b.count == 1 and len(b.pieces) == 1:  # one range of one file (or zeros): rows by arithmetic
            path, off, n, _ = b.pieces[0]
            row = n // count
            return Rows(count, ((path, off, row, 0 if path is None else row),))
        return None

    def narrow(self, axis: int, start: int, length: int) -> "Stored":
        """`tensor.narrow(axis, start, length)`, where indices at or past shape[axis] read as zeros (padding)."""
        ax = axis % len(self.shape)
        size = self.shape[ax]
        inner = _prod(self.shape[ax + 1:]) * _elsize(self.dtype)
        real = max(0, min(start + length, size) - start)
        pad = ((None, 0, (length - real) * inner, 0),)
        outer = _prod(self.shape[:ax])
        rows = self._as_rows(outer) if outer and size * inner else None
        if rows is not None:  # every row's window at once
            blocks = [Rows(outer, _columns(rows.pieces, 0, start * inner, (start + real) * inner) + pad)]
        else:  # row by row (a cut across blocks of another layout)
            blocks = []
            for o in range(outer):
                blocks += self._window((o * size + start) * inner, real * inner) + [Rows(1, pad)]
        shape = list(self.shape)
        shape[ax] = length
        return Stored(self.dtype, tuple(shape), _normal(blocks))

    @staticmethod
    def cat(parts: Sequence["Stored"], axis: int) -> "Stored":
        """`torch.cat(parts, axis)`."""
        first = parts[0]
        ax = axis % len(first.shape)
        inner = _prod(first.shape[ax + 1:]) * _elsize(first.dtype)
        outer = _prod(first.shape[:ax])
        rows = [p._as_rows(outer) if outer and p.shape[ax] * inner else Rows(outer, ()) for p in parts]
        if all(r is not None for r in rows):  # every row's parts side by side at once
            blocks = [Rows(outer, sum((r.pieces for r in rows), ()))]
        else:
            blocks = []
            for o in range(outer):
                for p in parts:
                    run = p.shape[ax] * inner
                    blocks += p._window(o * run, run)
        shape = list(first.shape)
        shape[ax] = sum(p.shape[ax] for p in parts)
        return Stored(first.dtype, tuple(shape), _normal(blocks))

    def read(self, at: int, n: int) -> bytes:
        """Bytes [at, at + n) of the tensor."""
        out = np.empty(n, dtype=np.uint8)
        with _Files() as files:
            _fill(out, self._window(at, n), files)
        return out.tobytes()

    def same_bytes(self, other: "Stored", chunk: int = 4 << 20) -> bool:
        if self.nbytes != other.nbytes:
            return False
        return all(self.read(at, min(chunk, self.nbytes - at)) == other.read(at, min(chunk, self.nbytes - at))
                   for at in range(0, self.nbytes, chunk))

    def tensor(self) -> torch.Tensor:
        """An owned copy in memory."""
        out = torch.empty(self.nbytes, dtype=torch.uint8)
        with _Files() as files:
            _fill(out.numpy(), self.blocks, files)
        return out.view(self.dtype).reshape(self.shape)

    def mapped(self) -> torch.Tensor:
        """The tensor without copying it: a private map of its file region (pages are shared with the page cache
        until written, which nothing here does), or an owned copy where it is not one range of one file."""
        one = self.blocks[0].pieces if len(self.blocks) == 1 and self.blocks[0].count == 1 else ()
        if len(one) != 1 or one[0][0] is None:
            return self.tensor()
        path, off, n, _ = one[0]
        base = off - off % mmap.ALLOCATIONGRANULARITY
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), off - base + n, access=mmap.ACCESS_COPY, offset=base)
        t = torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=off - base)  # keeps `mm` alive
        return t.view(self.dtype).reshape(self.shape)


def as_tensor(t) -> torch.Tensor:
    """A tensor for code that computes with the values: a Stored tensor mapped, a tensor as it is."""
    return t.mapped() if isinstance(t, Stored) else t


class _Files:
    """Source files opened (read-only) once each, for as long as a `with` block."""

    def __init__(self):
        self._fds: dict[str, int] = {}

    def fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def __enter__(self) -> "_Files":
        return self

    def __exit__(self, *exc) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _pread_into(files: _Files, path: str, off: int, view: memoryview) -> None:
    """Fills `view` from `path` at `off`, or a PmxError naming the file where it ends first."""
    done = 0
    while done < len(view):
        k = os.preadv(files.fd(path), [view[done:]], off + done)
        if k == 0:
            raise PmxError(f"{path}: cut short (expected {len(view)} bytes at offset {off})")
        done += k


def _chunk_rows(b: Rows, out_bytes: int) -> int:
    """Rows of `b` gathered at a time: as many as fit in `out_bytes` of output with at most SOURCE_BYTES of source
    rows (gaps included) per piece; at least one."""
    stride = max([p[3] for p in b.pieces if p[0] is not None] + [1])
    return max(1, min(out_bytes // max(b.row_bytes, 1), SOURCE_BYTES // stride))


def _gather_rows(out: np.ndarray, b: Rows, first: int, files: _Files, scratch: Scratch) -> None:
    """Rows first .. first + len(out) - 1 of block `b` into `out` ([rows, row bytes]): each piece's source rows read
    with one pread, the gaps between them included, into `scratch`, then copied strided into its columns (cheaper
    than mapping them: no page tables to fill and tear down); a long piece read row by row straight into place."""
    k, col = len(out), 0
    for path, off, n, stride in b.pieces:
        view = out[:, col:col + n]
        col += n
        if path is None:
            view.fill(0)
        elif n >= KERNEL_COPY_MIN_RUN or k == 1:
            for r in range(k):
                _pread_into(files, path, off + (first + r) * stride, memoryview(view[r]))
        else:
            src = scratch.take("source", torch.uint8, ((k - 1) * stride + n,)).numpy()
            _pread_into(files, path, off + first * stride, memoryview(src))
            np.copyto(view, np.lib.stride_tricks.as_strided(src, (k, n), (stride, 1)))


def _fill(out: np.ndarray, blocks: Sequence[Rows], files: _Files) -> None:
    """Fills `out` (uint8, as long as `blocks`) with the bytes of `blocks`: whole ranges read straight in, rows of
    short pieces through a buffer of at most SOURCE_BYTES."""
    pos, scratch = 0, Scratch()
    for b in blocks:
        rows = out[pos:pos + b.nbytes].reshape(b.count, b.row_bytes)
        step = _chunk_rows(b, b.nbytes)
        for r in range(0, b.count, step):
            _gather_rows(rows[r:r + step], b, r, files, scratch)
        pos += b.nbytes


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


class _StoredWriter:
    """Writes one Stored tensor's blocks at an output fd's position: by kernel copy (copy_file_range, else sendfile,
    else neither: then gathered) where pieces are long, else gathered through `scratch`."""

    def __init__(self, fd: int, files: _Files, scratch: Scratch):
        self.fd, self.files, self.scratch = fd, files, scratch
        self.how = "copy_file_range"  # -> "sendfile" where refused -> "gather" where both are
        self.copied = False  # once a byte went by kernel copy, a refusal is an error, not a reason to fall back

    def block(self, b: Rows) -> None:
        files = sum(1 for p in b.pieces if p[0] is not None)
        if files and b.row_bytes >= KERNEL_COPY_MIN_RUN * len(b.pieces) and self.how != "gather":
            start = None if self.copied else os.lseek(self.fd, 0, os.SEEK_CUR)
            if self._kernel_copy(b):
                return
            os.lseek(self.fd, start, os.SEEK_SET)  # refused before a byte was copied: zeros written go again
        if b.count == 1:
            self._ranges(b.pieces)
        else:
            self._gather(b)

    def _kernel_copy(self, b: Rows) -> bool:
        """Each row's pieces copied inside the kernel; False where that is refused (before any byte was copied)."""
        for r in range(b.count):
            for path, off, n, stride in b.pieces:
                if path is None:
                    _write_all(self.fd, _zero_views(n))
                elif not self._copy(path, off + r * stride, n):
                    return False
        return True

    def _copy(self, path: str, off: int, n: int) -> bool:
        src, done = self.files.fd(path), 0
        while done < n:
            try:
                if self.how == "sendfile":
                    k = os.sendfile(self.fd, src, off + done, n - done)
                else:
                    k = os.copy_file_range(src, self.fd, n - done, off + done)
            except OSError as e:
                if e.errno not in _NO_KERNEL_COPY or self.copied:
                    raise
                self.how = "sendfile" if self.how == "copy_file_range" else "gather"
                if self.how == "gather":
                    return False
                continue
            if k == 0:
                raise PmxError(f"{path}: cut short (expected {n} bytes at offset {off})")
            done += k
            self.copied = True
        return True

    def _ranges(self, pieces: Sequence[Piece]) -> None:
        """One row's pieces, read through the buffer GATHER_BYTES at a time."""
        for path, off, n, _ in pieces:
            if path is None:
                _write_all(self.fd, _zero_views(n))
                continue
            for at in range(0, n, GATHER_BYTES):
                k = min(GATHER_BYTES, n - at)
                view = memoryview(self.scratch.take("rows", torch.uint8, (k,)).numpy())
                _pread_into(self.files, path, off + at, view)
                _write_all(self.fd, [view])

    def _gather(self, b: Rows) -> None:
        """Rows gathered into the buffer, GATHER_BYTES of them (at least one row) at a time, each such block written
        with one write."""
        size, step = b.row_bytes, _chunk_rows(b, GATHER_BYTES)
        for r in range(0, b.count, step):
            out = self.scratch.take("rows", torch.uint8, (min(step, b.count - r), size)).numpy()
            _gather_rows(out, b, r, self.files, self.scratch)
            _write_all(self.fd, [memoryview(out.reshape(-1))])


def write_stored(fd: int, t: Stored, scratch: Optional[Scratch] = None) -> None:
    """Appends the bytes of `t` to `fd` (at its position), gathering short rows through `scratch` (reused from call
    to call; default a fresh one): see the module's docstring."""
    with _Files() as files:
        w = _StoredWriter(fd, files, Scratch() if scratch is None else scratch)
        for b in t.blocks:
            w.block(b)


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
