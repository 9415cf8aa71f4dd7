"""Tensor storage: lazy safetensors reading, streaming safetensors writing, atomic output directories.

The writer knows every tensor's name, dtype and shape before the first byte of data (the caller
plans the output), writes the safetensors header, then appends each tensor as it is produced. So
peak memory follows the largest tensor, never the model. Files are deterministic: the same plan
gives the same bytes, which is what lets merge(split(m)) reproduce m bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors import safe_open

from runner.errors import PmxError

ST_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
    torch.bool: "BOOL",
}
TORCH_DTYPES = {v: k for k, v in ST_DTYPES.items()}
DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in DTYPE_NAMES.items():
        if d == dtype:
            return name
    raise PmxError(f"unsupported weight dtype {dtype}; expected one of {', '.join(DTYPE_NAMES)}")


class SafetensorsWriter:
    """Streams tensors into one safetensors file in a planned order.

    >>> w = SafetensorsWriter(path, [("a", torch.float32, (2, 3))]); w.write("a", t); w.close()
    """

    def __init__(self, path: Path, plan: Sequence[tuple[str, torch.dtype, tuple]], metadata: dict | None = None):
        self.path = Path(path)
        self.plan = list(plan)
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for name, dtype, shape in self.plan:
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._f = open(self.path, "wb")
        self._f.write(struct.pack("<Q", len(blob)))
        self._f.write(blob)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, dtype, shape = self.plan[self._next]
        if name != want_name or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise AssertionError(f"{self.path}: writing {name} {tensor.dtype} {tuple(tensor.shape)}, "
                                 f"planned {want_name} {dtype} {tuple(shape)}")
        t = tensor.detach().contiguous().cpu()
        if t.numel():
            self._f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.plan):
            missing = [n for n, _, _ in self.plan[self._next:]]
            raise AssertionError(f"{self.path}: closed with {len(missing)} planned tensors unwritten ({missing[:3]} ...)")
        self._f.close()

    def abort(self) -> None:
        self._f.close()


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class SafetensorsReader:
    """A lazily read safetensors file: names, shapes and dtypes from its header; data on demand.

    Errors (missing, truncated or corrupt file, unknown tensor) name the file.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise PmxError(f"{self.path}: file not found")
        try:
            self._f = safe_open(str(self.path), framework="pt")
        except Exception as e:  # safetensors raises its own error types for bad headers and short files
            raise PmxError(f"{self.path}: not a valid safetensors file ({e})") from None
        self._keys = _keys_in_file_order(self.path)

    def keys(self) -> list[str]:
        return list(self._keys)

    def metadata(self) -> dict:
        return self._f.metadata() or {}

    def shape(self, name: str) -> tuple:
        return tuple(self._f.get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return TORCH_DTYPES[self._f.get_slice(name).get_dtype()]

    def get(self, name: str) -> torch.Tensor:
        if name not in self._keys:
            raise PmxError(f"{self.path}: has no tensor {name!r}")
        try:
            return self._f.get_tensor(name)
        except Exception as e:
            raise PmxError(f"{self.path}: cannot read tensor {name!r} ({e})") from None


def _keys_in_file_order(path: Path) -> list[str]:
    """Tensor names in the order their data lies in the file (safe_open sorts them by name)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return sorted(header, key=lambda k: header[k]["data_offsets"][0])


@contextlib.contextmanager
def atomic_output_dir(output_dir: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yields a temporary directory beside `output_dir`; renames it into place only on success.

    An existing non-empty `output_dir` is refused unless `overwrite`. On any error the temporary
    directory is removed, so no partial output is ever left behind.
    """
    out = Path(output_dir).resolve()
    if out.exists():
        if not out.is_dir():
            raise PmxError(f"{out}: exists and is not a directory")
        if any(out.iterdir()) and not overwrite:
            raise PmxError(f"{out}: output directory exists and is not empty (pass --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the output is an ordinary directory
    try:
        yield tmp
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "x")
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copies whichever tokenizer files `src` has into `dst`; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied
