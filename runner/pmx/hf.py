"""Lazy access to a HuggingFace checkpoint directory.

Reads `config.json` and whichever weight layout the directory has: `model.safetensors`, sharded
safetensors with `model.safetensors.index.json`, `pytorch_model.bin`, or sharded `.bin` with
`pytorch_model.bin.index.json`. Safetensors are memory-mapped and read one tensor at a time;
`.bin` files are loaded with `weights_only=True` and `mmap=True`, so they are not read into RAM
either.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from runner.errors import PmxError
from runner.pmx.store import SafetensorsReader
from runner.pmx.stored import Stored

LAYOUTS = (  # (index file, single file)
    ("model.safetensors.index.json", "model.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin"),
)


class BinFile:
    """A pytorch `.bin` state dict, memory-mapped (zip format) and loaded without pickle code execution."""

    def __init__(self, path: Path):
        self.path = path
        if not path.is_file():
            raise PmxError(f"{path}: file not found")
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise PmxError(f"{path}: cannot load ({e})") from None
            sd = torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format
        except Exception as e:
            raise PmxError(f"{path}: not a loadable weights_only pytorch file ({e})") from None
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise PmxError(f"{path}: expected a dict of tensors")
        self._sd = sd

    def keys(self):
        return list(self._sd)

    def shape(self, name):
        return tuple(self._sd[name].shape)

    def dtype(self, name):
        return self._sd[name].dtype

    def get(self, name):
        return self._sd[name]


class HFCheckpoint:
    """Names, shapes, dtypes and lazily read tensors of a HF checkpoint directory."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise PmxError(f"{self.dir}: input directory not found")
        cfg = self.dir / "config.json"
        if not cfg.is_file():
            raise PmxError(f"{cfg}: missing; a HuggingFace checkpoint directory needs its config.json")
        try:
            self.config = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise PmxError(f"{cfg}: not valid JSON ({e})") from None
        self._files: dict = {}
        self._where: dict[str, str] = {}  # tensor name -> file name
        self._open_layout()
        self.aliases = self._aliases()

    def _open_layout(self) -> None:
        for index_name, single_name in LAYOUTS:
            index = self.dir / index_name
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise PmxError(f"{index}: expected a JSON object with a 'weight_map' ({e})") from None
                for fname in sorted(set(weight_map.values())):
                    if not (self.dir / fname).is_file():
                        raise PmxError(f"{self.dir / fname}: named in {index_name} but missing")
                for name, fname in weight_map.items():
                    if name not in self._file(fname).keys():
                        raise PmxError(f"{self.dir / fname}: {index_name} says it holds {name!r}, it does not")
                self._where = dict(weight_map)
                return
            if (self.dir / single_name).is_file():
                self._where = {k: single_name for k in self._file(single_name).keys()}
                return
        raise PmxError(f"{self.dir}: no weights found; expected model.safetensors, model.safetensors.index.json, "
                       f"pytorch_model.bin or pytorch_model.bin.index.json")

    def _file(self, fname: str):
        if fname not in self._files:
            path = self.dir / fname
            self._files[fname] = SafetensorsReader(path) if fname.endswith(".safetensors") else BinFile(path)
        return self._files[fname]

    def _aliases(self) -> dict:
        """Names that the safetensors metadata declares as stored under another name (tied weights)."""
        aliases = {}
        for fname in set(self._where.values()):
            f = self._file(fname)
            if isinstance(f, SafetensorsReader):
                for k, v in f.metadata().items():
                    if v in self._where and k not in self._where and k != "format":
                        aliases[k] = v
        return aliases

    def keys(self) -> list[str]:
        return list(self._where)

    def locate(self, name: str) -> str:
        """Path of the file holding `name` (for error messages)."""
        return str(self.dir / self._where[name])

    def shape(self, name: str) -> tuple:
        return self._file(self._where[name]).shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self._file(self._where[name]).dtype(name)

    def get(self, name: str) -> torch.Tensor:
        return self._file(self._where[name]).get(name)

    def stored(self, name: str) -> torch.Tensor | Stored:
        """Tensor `name` left in its safetensors file (runner/pmx/stored.py); a `.bin` file's tensor as it is."""
        f = self._file(self._where[name])
        return f.stored(name) if isinstance(f, SafetensorsReader) else f.get(name)
