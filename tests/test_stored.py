"""Tensors left in their files (runner/pmx/stored.py): cut, put together and written by the kernel's copy, bit for
bit what the same operations on tensors in memory give; and convert / split / merge going through them."""

from __future__ import annotations

import errno
import filecmp
import os

import pytest
import torch

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
