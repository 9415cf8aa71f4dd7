"""Step dumps in ppl.pmx's layout: `<root>/rank_{r}/step{S}_{name}-{d0}_{d1}_..._{dn}-{dtype}.bin`.

Raw little-endian C-order bytes; dtype one of fp32 fp16 bf16 int8 int64. A dumper belongs to one
engine run (no globals). :func:`load_step` reads a step back, checking each file's size against
the shape and dtype in its name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import torch

from runner.errors import PmxError
from runner.pmx.store import atomic_file

DUMP_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "int8",
               torch.int64: "int64"}
FROM_NAME = {v: k for k, v in DUMP_DTYPES.items()}
FILE_RE = re.compile(r"step(\d+)_(.+)-([0-9_]*)-(fp32|fp16|bf16|int8|int64)\.bin")
STEP_INPUTS = ("token_ids", "attn_mask", "seqstarts", "kvstarts", "cachestarts", "decoding_batches", "start_pos",
               "max_seqlen", "max_kvlen", "kv_cache", "kv_scale")
META_FILE = "engine.json"


def dump_file_name(step: int, name: str, t: torch.Tensor) -> str:
    dims = "_".join(str(d) for d in t.shape)
    return f"step{step}_{name}-{dims}-{DUMP_DTYPES[t.dtype]}.bin"


def write_tensor(directory: Path, step: int, name: str, t: torch.Tensor, what: str = "the step dump") -> Path:
    """Writes one step tensor (atomically; `directory` is created if needed) and returns its path."""
    if t.dtype not in DUMP_DTYPES:
        t = t.to(torch.int64 if not t.dtype.is_floating_point else torch.float32)
    t = t.reshape(1) if t.dim() == 0 else t
    path = Path(directory) / dump_file_name(step, name, t)
    data = t.detach().contiguous().cpu()
    with atomic_file(path, what) as tmp:
        data.view(torch.uint8).numpy().tofile(tmp) if data.numel() else tmp.write_bytes(b"")
    return path


def check_output_dir(directory: Path) -> None:
    """Refuses, before any work, a directory path with a part that exists and is not a directory."""
    for p in (Path(directory), *Path(directory).parents):
        if p.exists():
            if not p.is_dir():
                raise PmxError(f"{directory}: cannot create the directory: {p} exists and is not a directory")
            return


class TensorDumper:
    """Writes the inputs and logits of chosen steps of one generation run for one rank.

    `meta` (the engine options, dtype and device of the run) goes to `rank_{r}/engine.json` beside the
    step files, so that a replay runs the step exactly as it was run; replay also works without it.
    The rank's folder is checked when the dumper is made and created with the first step written, so a
    run that fails before leaves no empty folder behind.
    """

    def __init__(self, root: str, rank: int, steps: Optional[Iterable[int]] = None, meta: Optional[dict] = None):
        self.dir = Path(root) / f"rank_{rank}"
        check_output_dir(self.dir)
        self.steps = None if not steps else {int(s) for s in steps}  # None: every step
        self.meta = meta
        self._meta_written = False

    def wants(self, step: int) -> bool:
        return self.steps is None or step in self.steps

    def dump(self, step: int, tensors: dict) -> None:
        if self.meta is not None and not self._meta_written:
            with atomic_file(self.dir / META_FILE, "the dump's engine.json") as tmp:
                tmp.write_text(json.dumps(self.meta, indent=1, sort_keys=True) + "\n")
            self._meta_written = True
        for name, t in tensors.items():
            if t is not None:
                write_tensor(self.dir, step, name, torch.as_tensor(t))


def parse_dump_name(path: Path) -> Optional[tuple[int, str, tuple, torch.dtype]]:
    """(step, name, shape, dtype) from a dump file's name, or None for a file that is not a step dump."""
    m = FILE_RE.fullmatch(Path(path).name)
    if not m:
        return None
    dims = m.group(3)
    return int(m.group(1)), m.group(2), tuple(int(x) for x in dims.split("_")) if dims else (0,), FROM_NAME[m.group(4)]


def read_dump_file(path: Path) -> torch.Tensor:
    """The tensor of one dump file; its size must match the shape and dtype its name gives."""
    path = Path(path)
    parsed = parse_dump_name(path)
    if parsed is None:
        raise PmxError(f"{path}: not a step dump file (expected step<S>_<name>-<d0>_<d1>..-<dtype>.bin)")
    _, _, shape, dt = parsed
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dt).element_size()
    size = path.stat().st_size
    if size != nbytes:
        raise PmxError(f"{path}: holds {size} bytes, its name says {list(shape)} {DUMP_DTYPES[dt]} = {nbytes} bytes")
    raw = torch.from_numpy(np.fromfile(path, dtype=np.uint8)) if nbytes else torch.empty(0, dtype=torch.uint8)
    return raw.view(dt).reshape(shape)


def dump_files(directory: Path) -> dict[tuple[int, str], Path]:
    """{(step, name): path} of the step dump files in one rank's folder."""
    out = {}
    for path in sorted(Path(directory).glob("step*.bin")):
        parsed = parse_dump_name(path)
        if parsed is not None:
            out[(parsed[0], parsed[1])] = path
    return out


def load_step(directory: str, step: int) -> dict[str, torch.Tensor]:
    """{name: tensor} of every tensor dumped for `step` in `directory` (one rank's dump folder)."""
    d = Path(directory)
    if not d.is_dir():
        raise PmxError(f"{d}: dump directory not found")
    out = {name: read_dump_file(path) for (s, name), path in dump_files(d).items() if s == step}
    if not out:
        steps = sorted({s for s, _ in dump_files(d)})
        raise PmxError(f"{d}: no tensors dumped for step {step}" + (f" (it holds steps {steps})" if steps else ""))
    return out


def load_rank_step(dump_dir: str, step: int, rank: int, world_size: int, what: str
                   ) -> tuple[Path, Optional[dict], dict[str, torch.Tensor]]:
    """(rank `rank`'s dump folder, its run's meta, its step `step` with every replay input and the logits), checked
    against the `world_size` ranks started to replay it (`what`: the replay, named in the error)."""
    rank_dir = Path(dump_dir) / f"rank_{rank}"
    if not rank_dir.is_dir():
        raise PmxError(f"{dump_dir}: has no rank_{rank} (dump with Demo.py --dump_tensor_path {dump_dir} on as "
                       f"many ranks as {what})")
    meta = load_meta(str(rank_dir))
    if meta and meta.get("world_size", world_size) != world_size:
        raise PmxError(f"{rank_dir / META_FILE}: the dump was made on {meta['world_size']} rank(s), but "
                       f"{world_size} were started; replay it with -np {meta['world_size']}")
    t = load_step(str(rank_dir), int(step))
    missing = [n for n in STEP_INPUTS + ("logits",) if n not in t and n != "kv_scale"]
    if missing:
        raise PmxError(f"{rank_dir}: step {step} lacks {missing}")
    return rank_dir, meta, t


def load_meta(directory: str) -> Optional[dict]:
    """The run's engine.json written beside the step files, or None (e.g. a ppl.pmx dump)."""
    path = Path(directory) / META_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PmxError(f"{path}: not valid JSON ({e})") from None
