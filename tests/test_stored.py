"""Tensors left in their files (runner/pmx/stored.py): cut, put together and written by the kernel's copy, bit for
bit what the same operations on tensors in memory give; and convert / split / merge going through them."""

from __future__ import annotations

import errno
import filecmp
import os

import pytest
import torch
import torch.nn.functional as F

import runner.pmx.stored as stored_mod
from runner.pmx.convert import PmxModel, convert, reshard
from runner.pmx.store import SafetensorsReader, SafetensorsWriter
from runner.pmx.stored import Scratch, Stored


def stored_tensors(tmp_path, tensors: dict) -> dict:
    """{name: (tensor, Stored of it in a safetensors file)}."""
    path = tmp_path / "t.safetensors"
    w = SafetensorsWriter(path, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()])
    for k, t in tensors.items():
        w.write(k, t)
    w.close()
    rd = SafetensorsReader(path)
    return {k: (t, rd.stored(k)) for k, t in tensors.items()}


def written(tmp_path, t) -> torch.Tensor:
    """`t` (a tensor or Stored) written by SafetensorsWriter and read back."""
    path = tmp_path / f"w{len(os.listdir(tmp_path))}.safetensors"
    w = SafetensorsWriter(path, [("x", t.dtype, tuple(t.shape))])
    w.write("x", t)
    w.close()
    return SafetensorsReader(path).get("x")


SHAPES = [(7, 5), (3, 4, 6), (1, 9), (10,), (2, 3, 2, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("min_run", [0, 1 << 40])  # every range by kernel copy / every one by writev from a map
def test_narrow_and_cat_match_torch(tmp_path, monkeypatch, dtype, min_run):
    monkeypatch.setattr(stored_mod, "KERNEL_COPY_MIN_RUN", min_run)
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": (torch.randn(s, generator=g) * 50).to(dtype) for i, s in enumerate(SHAPES)}
    for t, s in stored_tensors(tmp_path, tensors).values():
        assert torch.equal(s.tensor(), t) and torch.equal(s.mapped(), t) and torch.equal(written(tmp_path, s), t)
        for ax in range(t.dim()):
            n = t.shape[ax]
            for start, length in [(0, n), (1, max(n - 2, 0)), (n - 1, 3), (0, n + 2)]:  # the last two: padded
                want = t.narrow(ax, start, min(length, n - start))
                pad = list(t.shape)
                pad[ax] = length - want.shape[ax]
                want = torch.cat([want, torch.zeros(pad, dtype=dtype)], ax)
                part = s.narrow(ax, start, length)
                assert part.shape == want.shape and torch.equal(part.tensor(), want)
                assert torch.equal(written(tmp_path, part), want)
                assert part.read(0, part.nbytes) == want.contiguous().view(torch.uint8).numpy().tobytes()
            halves = [s.narrow(ax, 0, n // 2), s.narrow(ax, n // 2, n - n // 2)]
            back = Stored.cat(halves, ax)
            assert torch.equal(back.tensor(), t) and torch.equal(written(tmp_path, back), t)
            assert back.narrow(ax, 0, n).same_bytes(s)


def test_strided_tensors_are_written_row_by_row(tmp_path):
    t = torch.randn(64, 96)
    for view in (t[:, 16:80], t.view(4, 2, 8, 96).transpose(1, 2), t.t()[:5]):  # a column cut, rotary rows, strided
        assert torch.equal(written(tmp_path, view), view.contiguous())


@pytest.mark.parametrize("refuse", [("copy_file_range",), ("copy_file_range", "sendfile")])
def test_kernel_copy_falls_back_where_it_is_refused(tmp_path, monkeypatch, refuse):
    """copy_file_range refused (EXDEV: another filesystem, on old kernels) -> sendfile; both -> writev from a map."""
    monkeypatch.setattr(stored_mod, "KERNEL_COPY_MIN_RUN", 0)
    calls = []

    def refused(name):
        def call(*args):
            calls.append(name)
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        return call
    for name in refuse:
        monkeypatch.setattr(os, name, refused(name))
    t, s = stored_tensors(tmp_path, {"x": torch.arange(3000.0).reshape(30, 100)})["x"]
    assert torch.equal(written(tmp_path, s.narrow(0, 10, 25)), torch.cat([t[10:], torch.zeros(5, 100)]))
    assert calls[:len(refuse)] == list(refuse)


def test_scratch_reuses_its_memory():
    sc = Scratch()
    a = sc.take("k", torch.float32, (4, 8))
    b = sc.take("k", torch.bfloat16, (3,))
    assert a.data_ptr() == b.data_ptr() and b.shape == (3,)
    assert sc.take("k", torch.float32, (100,)).numel() == 100


def test_convert_split_merge_move_untouched_tensors_by_kernel_copy(make_hf, tmp_path, monkeypatch):
    """With every range large enough for the kernel copy, conversion copies every tensor but the rotary q / k rows
    with copy_file_range, split and merge every byte; and the files are those the writev path gives."""
    src, _ = make_hf("llama_gqa_odd")
    real = os.copy_file_range
    copied = []

    def spy(src_fd, dst_fd, count, offset_src=None, offset_dst=None):
        copied.append(real(src_fd, dst_fd, count, offset_src, offset_dst))
        return copied[-1]
    monkeypatch.setattr(os, "copy_file_range", spy)
    outs = {}
    for min_run in (0, 1 << 40):
        monkeypatch.setattr(stored_mod, "KERNEL_COPY_MIN_RUN", min_run)
        d = outs[min_run] = tmp_path / f"run{min_run}"
        steps = {"full": lambda: convert(str(src), str(d / "full"), progress=False),
                 "split": lambda: reshard(str(d / "full"), str(d / "split"), 4, progress=False),
                 "merged": lambda: reshard(str(d / "split"), str(d / "merged"), 1, progress=False)}
        for step, run in steps.items():
            copied.clear()
            run()
            if min_run:
                assert not copied
                continue
            rd = SafetensorsReader(d / "full" / "model.00.safetensors")
            rotary = sum(rd.nbytes(f"layers.{i}.attention.{w}.weight") for i in range(2) for w in ("wq", "wk"))
            shards = sum(SafetensorsReader(d / "split" / f"model.{r:02d}.safetensors").data_bytes() for r in range(4)
                         if step != "full")
            # zero padding, written from memory: w1 / w3 rows and w2 columns of intermediate 70 -> 72 (2 layers),
            # output rows of vocabulary 77 -> 80; float32 of hidden 48
            zeros = (2 * 3 * 2 + 3) * 48 * 4
            want = {"full": rd.data_bytes() - rotary, "split": shards - zeros, "merged": rd.data_bytes()}[step]
            assert sum(copied) == want, step
    for sub in ("full", "split", "merged"):
        for f in sorted((outs[0] / sub).iterdir()):
            assert filecmp.cmp(f, outs[1 << 40] / sub / f.name, shallow=False), f
    assert filecmp.cmp(outs[0] / "full" / "model.00.safetensors", outs[0] / "merged" / "model.00.safetensors",
                       shallow=False)


def shard_files(tmp_path, parts: list, name: str) -> list:
    """Each Stored part written by write_stored to a file of its own, read back as a Stored tensor of that file."""
    out = []
    for i, part in enumerate(parts):
        path = tmp_path / f"{name}{i}.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            stored_mod.write_stored(fd, part)
        finally:
            os.close(fd)
        out.append(Stored.of_file(path, 0, part.dtype, part.shape))
    return out


@pytest.mark.parametrize("shape,axis", [((37, 70), -1), ((3, 11, 26), -1), ((3, 11, 26), -2)])
def test_column_cuts_and_joins_are_gathered_a_block_of_rows_at_a_time(tmp_path, monkeypatch, shape, axis):
    """A row-parallel cut into 3 with padding (70 -> 72 columns) and its join: one block of rows each (no range per
    row), moved by one write per block of rows through buffers smaller than the tensor (several blocks of rows, and
    rows longer than the buffer), bit for bit what torch's narrow and cat give."""
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(shape, generator=g) * 50).to(torch.bfloat16)
    _, s = stored_tensors(tmp_path, {"t": t})["t"]
    n = t.shape[axis]
    per = -(-n // 3)
    padded = torch.cat([t, torch.zeros(*t.shape[:axis % t.dim()], 3 * per - n, *t.shape[axis % t.dim() + 1:],
                                       dtype=t.dtype)], axis)
    writes = []
    real = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, views: writes.append(len(views)) or real(fd, views))
    parts = [s.narrow(axis, r * per, per) for r in range(3)]
    rows = t.shape[:axis % t.dim()].numel()
    assert all(len(p.blocks) == 1 and p.blocks[0].count == rows for p in parts)  # arithmetic, not a range per row
    for out_bytes, source_bytes in [(50, 1 << 20), (300, 1 << 20), (1 << 20, 500)]:  # 50: rows longer than that
        monkeypatch.setattr(stored_mod, "GATHER_BYTES", out_bytes)
        monkeypatch.setattr(stored_mod, "SOURCE_BYTES", source_bytes)
        writes.clear()
        files = shard_files(tmp_path, parts, "part")
        for r, f in enumerate(files):
            assert torch.equal(f.tensor(), padded.narrow(axis, r * per, per))
        chunks = [-(-rows // stored_mod._chunk_rows(p.blocks[0], out_bytes)) for p in parts]
        assert writes == [1] * sum(chunks)  # one write per block of rows (37 x 48 B by 300: 7 writes, not 37)
        joined = Stored.cat(files, axis).narrow(axis, 0, n)
        assert len(joined.blocks) == 1 and joined.blocks[0].count == rows and len(joined.blocks[0].pieces) == 3
        (back,) = shard_files(tmp_path, [joined], "joined")
        assert torch.equal(back.tensor(), t) and back.same_bytes(s)
        assert torch.equal(joined.tensor(), t) and torch.equal(written(tmp_path, joined), t)
        assert torch.equal(parts[2].tensor(), padded.narrow(axis, 2 * per, per))
    if axis == -1 and len(shape) == 2:  # rows of 48 B, 140 B apart
        assert stored_mod._chunk_rows(parts[0].blocks[0], 1 << 20) == 3  # 500 B of source
        monkeypatch.setattr(stored_mod, "SOURCE_BYTES", 1 << 20)
        assert stored_mod._chunk_rows(parts[0].blocks[0], 300) == 6  # 300 B of output


def test_cuts_across_blocks_of_another_layout_go_row_by_row(tmp_path):
    """A column cut of a row join, a row cut of a column join: correct, if a range per row."""
    t = torch.arange(12 * 10, dtype=torch.int16).reshape(12, 10)
    _, s = stored_tensors(tmp_path, {"t": t})["t"]
    rows = Stored.cat([s.narrow(0, 6, 6), s.narrow(0, 0, 6)], 0)  # two blocks of whole rows
    cols = Stored.cat([s.narrow(1, 4, 6), s.narrow(1, 0, 4)], 1)  # one block of 12 rows of two pieces
    want_rows, want_cols = torch.cat([t[6:], t[:6]]), torch.cat([t[:, 4:], t[:, :4]], 1)
    for got, want in [(rows.narrow(1, 3, 9), F.pad(want_rows[:, 3:], (0, 2))),  # 2 columns of padding
                      (cols.narrow(0, 5, 9), F.pad(want_cols[5:], (0, 0, 0, 2))),  # 2 rows of padding
                      (Stored.cat([rows, cols], 1), torch.cat([want_rows, want_cols], 1)),
                      (cols.narrow(1, 2, 9).narrow(0, 1, 10), F.pad(want_cols[1:11, 2:], (0, 1)))]:
        assert got.shape == want.shape and torch.equal(got.tensor(), want) and torch.equal(written(tmp_path, got), want)
        assert got.read(3, 17) == want.contiguous().view(torch.uint8).numpy().tobytes()[3:20]
