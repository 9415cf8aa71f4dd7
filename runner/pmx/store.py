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

from runner.errors import PmxError
from runner.pmx.stored import Scratch, Stored, tensor_views, write_stored, write_views

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
        self._header = blob
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            write_views(self._fd, [memoryview(struct.pack("<Q", len(blob))), memoryview(blob)])
        except BaseException:
            os.close(self._fd)
            raise
        self._next = 0
        self._scratch = Scratch()  # where the rows of a column cut or join are gathered

    def patch_metadata(self, key: str, value: str) -> None:
        """Rewrites metadata `key` in the header already written (e.g. a fingerprint known only once every
        tensor has been seen); the new value must be as long as the placeholder it replaces."""
        meta = json.loads(self._header)["__metadata__"]
        old = json.dumps({key: meta[key]}, separators=(",", ":"))[1:-1].encode()
        new = json.dumps({key: value}, separators=(",", ":"))[1:-1].encode()
        at = self._header.index(old)
        if len(new) != len(old):
            raise AssertionError(f"{self.path}: metadata {key!r} must keep its length {len(old)}")
        self._header = self._header[:at] + new + self._header[at + len(new):]
        if os.pwrite(self._fd, new, 8 + at) != len(new):
            raise OSError(f"{self.path}: short write of its header")

    def write(self, name: str, tensor: torch.Tensor | Stored) -> None:
        """Appends tensor `name`, the next of the plan: a Stored tensor by kernel copy, the short rows of a column
        cut or join gathered through this writer's buffers (runner/pmx/stored.py); a tensor from its memory (a
        column cut or a permutation of rows by writev of its rows, with no copy)."""
        want_name, dtype, shape = self.plan[self._next]
        if name != want_name or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise AssertionError(f"{self.path}: writing {name} {tensor.dtype} {tuple(tensor.shape)}, "
                                 f"planned {want_name} {dtype} {tuple(shape)}")
        if isinstance(tensor, Stored):
            write_stored(self._fd, tensor, self._scratch)
        else:
            t = tensor.detach().cpu()
            views = tensor_views(t)
            if views is None:
                t = t.contiguous()
                views = tensor_views(t)
            write_views(self._fd, views)
            del views
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.plan):
            missing = [n for n, _, _ in self.plan[self._next:]]
            raise AssertionError(f"{self.path}: closed with {len(missing)} planned tensors unwritten ({missing[:3]} ...)")
        os.close(self._fd)

    def abort(self) -> None:
        os.close(self._fd)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class SafetensorsReader:
    """A safetensors file read one tensor at a time with plain reads (no mmap).

    Reading with `readinto` rather than through a memory map keeps the process's resident memory at
    the tensor being handled: pages of a mapped multi-GB file would all count towards RSS. The
    header is validated up front (offsets, sizes, file length), so a truncated or corrupt file is
    an error naming the file before any output is written.
    """

    MAX_HEADER = 100 << 20

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise PmxError(f"{self.path}: file not found")
        size = self.path.stat().st_size
        try:
            with open(self.path, "rb") as f:
                if size < 8:
                    raise ValueError("shorter than the 8-byte header length")
                (n,) = struct.unpack("<Q", f.read(8))
                if n > min(size - 8, self.MAX_HEADER):
                    raise ValueError(f"header length {n} does not fit in a {size}-byte file")
                header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
            self._meta = header.pop("__metadata__", None) or {}
            self._data_start = 8 + n
            end = 0
            for name, e in header.items():
                dtype = TORCH_DTYPES.get(e.get("dtype")) if isinstance(e, dict) else None
                if dtype is None:
                    raise ValueError(f"tensor {name!r}: unknown dtype {e.get('dtype') if isinstance(e, dict) else e!r}")
                b, t = e["data_offsets"]
                if t - b != _numel(e["shape"]) * torch.empty((), dtype=dtype).element_size() or b < 0:
                    raise ValueError(f"tensor {name!r}: data_offsets {e['data_offsets']} do not match shape {e['shape']}")
                end = max(end, t)
            if self._data_start + end != size:
                raise ValueError(f"header describes {self._data_start + end} bytes, the file has {size} "
                                 f"(truncated or padded)")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, struct.error) as e:
            raise PmxError(f"{self.path}: not a valid safetensors file ({e})") from None
        self._header = header
        self._keys = sorted(header, key=lambda k: header[k]["data_offsets"][0])  # file order

    def keys(self) -> list[str]:
        return list(self._keys)

    def metadata(self) -> dict:
        return dict(self._meta)

    def shape(self, name: str) -> tuple:
        return tuple(self._entry(name)["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return TORCH_DTYPES[self._entry(name)["dtype"]]

    def nbytes(self, name: str) -> int:
        b, t = self._entry(name)["data_offsets"]
        return t - b

    def data_bytes(self) -> int:
        return sum(self.nbytes(n) for n in self._keys)

    def _entry(self, name: str) -> dict:
        if name not in self._header:
            raise PmxError(f"{self.path}: has no tensor {name!r}")
        return self._header[name]

    def stored(self, name: str) -> Stored:
        """Tensor `name` left in the file (runner/pmx/stored.py): moved by the kernel, read only where needed."""
        e = self._entry(name)
        return Stored.of_file(self.path, self._data_start + e["data_offsets"][0], TORCH_DTYPES[e["dtype"]],
                              e["shape"])

    def get(self, name: str) -> torch.Tensor:
        e = self._entry(name)
        b, t = e["data_offsets"]
        buf = torch.empty(t - b, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self._data_start + b)
            if f.readinto(memoryview(buf.numpy())) != t - b:
                raise PmxError(f"{self.path}: tensor {name!r} is cut short")
        return buf.view(TORCH_DTYPES[e["dtype"]]).reshape(e["shape"])


def check_apart(output: Path, inputs: dict[str, Path], out_flag: str = "--output_dir",
                nested_ok: bool = False) -> None:
    """Refuses an output directory equal to, inside or containing one of `inputs` ({flag: path}): writing it
    (and with --overwrite, replacing it) would destroy the input. With `nested_ok`, only the same directory
    is refused (for outputs written file by file beside what is there)."""
    out = Path(output).resolve()
    for flag, path in inputs.items():
        src = Path(path).resolve()
        how = "is the same directory as" if out == src else None if nested_ok else \
            "is inside" if src in out.parents else "contains" if out in src.parents else None
        if how:
            raise PmxError(f"{out_flag} {output} {how} {flag} {path}; write the output somewhere else")


def _fs_error(path: Path, e: OSError) -> PmxError:
    return PmxError(f"{path}: cannot write the output ({e.strerror or e})")


@contextlib.contextmanager
def atomic_output_dir(output_dir: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yields a temporary directory beside `output_dir`; renames it into place only on success.

    An existing non-empty `output_dir` is refused unless `overwrite`, and so is a mount point (it cannot be
    replaced by a rename). On any error the temporary directory is removed, so no partial output is ever
    left behind; a filesystem error (read-only, full, not permitted, ...) is one line naming `output_dir`.
    """
    out = Path(output_dir).resolve()
    if out.exists():
        if not out.is_dir():
            raise PmxError(f"{out}: exists and is not a directory")
        if os.path.ismount(out):
            raise PmxError(f"{out}: is a mount point and cannot be replaced; write into a directory inside it")
        if any(out.iterdir()) and not overwrite:
            raise PmxError(f"{out}: output directory exists and is not empty (pass --overwrite to replace it)")
    made = _missing_parents(out)
    tmp = old = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the output is an ordinary directory
        yield tmp
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "x")
            try:
                os.replace(tmp, out)
            except OSError:
                os.replace(old / "x", out)  # put the previous output back
                raise
        else:
            os.replace(tmp, out)
    except OSError as e:
        _remove(tmp, old, made)
        raise _fs_error(out, e) from None
    except BaseException:
        _remove(tmp, old, made)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _missing_parents(path: Path) -> list[Path]:
    """The ancestors of `path` that do not exist yet, deepest first (removed again if writing fails)."""
    missing = []
    for parent in Path(path).parents:
        if parent.exists():
            break
        missing.append(parent)
    return missing


def _remove(tmp: Path | None, old: Path | None, made: list[Path]) -> None:
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    if old is not None and not (old / "x").exists():
        shutil.rmtree(old, ignore_errors=True)
    for d in made:  # deepest first; only those this call created, and only when empty
        try:
            d.rmdir()
        except OSError:
            break


@contextlib.contextmanager
def atomic_file(path: Path, what: str = "the output") -> Iterator[Path]:
    """Yields a temporary path beside `path` (its directory created if needed); renames it into place only
    on success. On failure the temporary file and the directories this call created are removed, and a
    filesystem error is one line naming `path`."""
    path = Path(path)
    made = _missing_parents(path) if not path.parent.is_dir() else []
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        _remove(None, None, made)
        if isinstance(e, OSError):
            raise PmxError(f"{path}: cannot write {what} ({e.strerror or e})") from None
        raise


TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "qwen.tiktoken", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json", "chat_template.jinja")


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copies whichever tokenizer files `src` has into `dst`; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied
