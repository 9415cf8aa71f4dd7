"""HF -> PMX conversion and re-sharding (split / merge), all streaming.

Every path ends in :func:`write_pmx`, which takes the unsplit params, the tensor plan and a
`fetch(name)` that yields one full tensor at a time, and writes `num_shards` safetensors files at
once. Peak memory is a small multiple of the largest tensor, whatever the model size.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from model_zoo import family_for, family_for_gguf
from model_zoo.decoder import GGUF_READ_INTO_PARAMS, unpermute_rotary
from runner.errors import PmxError
from runner.progress import progress_bar
from runner.pmx.fingerprint import FINGERPRINT, Fingerprint, check_shards, shard_metadata
from runner.pmx.hf import HFCheckpoint, BinFile
from runner.pmx.opmx import check_tensors, find_ppl_params, ppl_params
from runner.pmx.params import PmxParams, shard_file
from runner.pmx.gguf import DTYPE_OF, EXACT, FLOATS, GGUFCheckpoint, eos_ids, gguf_files, tokenizer_files
from runner.pmx.quant import (QUANT_PARTS, QuantScheme, is_quant_tensor, quant_parts, quantizable, quantize,
                              quantizing_fetch, tensor_dtype)
from runner.pmx.schema import pmx_tensors
from runner.pmx.shard import full_shape, merge_tensor, shard_shape, sharded_params, split_tensor, unsharded_params
from runner.pmx.store import (DTYPE_NAMES, _numel, SafetensorsReader, SafetensorsWriter, atomic_output_dir,
                              check_apart, copy_tokenizer_files, dtype_name)
from runner.pmx.stored import Scratch, Stored, as_tensor

Plan = Sequence[tuple[str, torch.dtype, tuple]]  # (name, dtype, full unsplit shape), in file order
ST_METADATA = {"format": "pt"}
PROGRESS_MIN_BYTES = 256 << 20  # below this, a progress bar only shows on a terminal


def write_pmx(out_dir: Path, params: PmxParams, plan: Plan, fetch: Callable[[str], torch.Tensor],
              num_shards: int, desc: str = "writing", progress: bool = True) -> PmxParams:
    """Writes `num_shards` shard files + pmx_params.json into `out_dir`; returns the written params."""
    sp = sharded_params(unsharded_params(params), num_shards)
    fingerprint = Fingerprint(params)
    total = sum(torch.empty((), dtype=dt).element_size() * _numel(shape) for _, dt, shape in plan)
    show = progress and (sys.stderr.isatty() or total > PROGRESS_MIN_BYTES)
    bar = progress_bar(total, desc, show=show)
    writers: list[SafetensorsWriter] = []
    try:
        for r in range(num_shards):
            writers.append(SafetensorsWriter(Path(out_dir) / shard_file(r),
                                             [(n, dt, shard_shape(sp, n, shape)) for n, dt, shape in plan],
                                             {**ST_METADATA, **shard_metadata(r, num_shards)}))
        for name, dt, shape in plan:
            t = fetch(name)
            if t.dtype != dt or tuple(t.shape) != tuple(shape):
                raise AssertionError(f"{name}: fetched {t.dtype} {tuple(t.shape)}, planned {dt} {tuple(shape)}")
            for w, part in zip(writers, split_tensor(sp, name, t)):
                w.write(name, part)
            fingerprint.add(name, t)
            bar.update(_numel(shape) * torch.empty((), dtype=dt).element_size())
            del t
        for w in writers:
            w.patch_metadata(FINGERPRINT, fingerprint.hexdigest())
            w.close()
    except BaseException:
        for w in writers:
            w.abort()
        raise
    finally:
        bar.close()
    sp.save(out_dir)
    return sp


def _write_dir(input_dir: Path, output_dir: str, overwrite: bool, params: PmxParams, plan: Plan,
               fetch: Callable[[str], torch.Tensor], num_shards: int, desc: str, progress: bool,
               quant: Optional[QuantScheme] = None, extras: Optional[dict] = None,
               copy_tokenizer: bool = True) -> PmxParams:
    """write_pmx into a temporary directory beside output_dir, with input_dir's tokenizer files (unless not
    `copy_tokenizer`; and `extras`, name -> text, written over them), then rename. With `quant`, the float model
    (params, plan, fetch) is written quantised."""
    check_apart(Path(output_dir), {"--input_dir": input_dir})
    if quant is not None:
        plan, fetch = quantizing_fetch(quant, plan, fetch)
        params = with_quant(params, quant)
    with atomic_output_dir(Path(output_dir), overwrite) as tmp:
        written = write_pmx(tmp, params, plan, fetch, num_shards, desc=desc, progress=progress)
        if copy_tokenizer:
            copy_tokenizer_files(input_dir, tmp)
        for name, text in (extras or {}).items():
            (tmp / name).write_text(text)
    return written


def convert(input_dir: str, output_dir: str, dtype: str = "auto", num_shards: int = 1, overwrite: bool = False,
            progress: bool = True, quant: Optional[QuantScheme] = None,
            report: Optional[Callable[[str], None]] = None) -> PmxParams:
    """Converts a HuggingFace checkpoint directory, a GGUF file (or a directory holding one, or the first part of a
    split set) or a ppl.pmx export into a PMX directory (optionally split, optionally with weight-only quantised
    linears, see runner/pmx/quant.py). `report` gets a GGUF's one line per tensor type (what came in, what was
    written)."""
    files = gguf_files(Path(input_dir))
    if files is not None:
        return convert_gguf(files, output_dir, dtype, num_shards, overwrite, progress, quant, report)
    ppl = find_ppl_params(Path(input_dir))
    if ppl is not None:
        return _convert_ppl(Path(input_dir), ppl, output_dir, dtype, num_shards, overwrite, progress, quant)
    ckpt = HFCheckpoint(Path(input_dir))
    cfg_path = str(Path(input_dir) / "config.json")
    family = family_for(ckpt.config, source=cfg_path)
    params = family.params(ckpt.config, _resolve_dtype(dtype, ckpt), source=cfg_path, directory=Path(input_dir))
    target = DTYPE_NAMES[params.dtype]
    sharded_params(with_quant(params, quant), num_shards)  # fail before any work if the cut is impossible

    available = set(ckpt.keys()) | set(ckpt.aliases)
    stored = lambda n: ckpt.aliases.get(n, n)  # noqa: E731 (the name a tied alias is stored under)
    sources, used = {}, set()
    for src in family.tensor_sources(params):
        if src.stacked:  # MoE experts: one HF tensor per expert, stacked [E, out, in]
            for n in src.stacked:
                if n not in available:
                    raise PmxError(f"{input_dir}: missing tensor {n!r} (needed for {src.pmx_name})")
                if tuple(ckpt.shape(stored(n))) != tuple(src.shape[1:]):
                    raise PmxError(f"{ckpt.locate(stored(n))}: tensor {n!r} has shape {list(ckpt.shape(stored(n)))}, "
                                   f"expected {list(src.shape[1:])} from config.json")
            sources[src.pmx_name] = (src, None)
            used.update(stored(n) for n in src.stacked)
            continue
        hf = next((n for n in src.hf_names if n in available), None)
        if hf is None:
            raise PmxError(f"{input_dir}: missing tensor {src.hf_names[0]!r} (needed for {src.pmx_name})")
        shape = ckpt.shape(stored(hf))
        if tuple(shape) != tuple(src.expected_hf_shape):
            raise PmxError(f"{ckpt.locate(stored(hf))}: tensor {hf!r} has shape {list(shape)}, "
                           f"expected {list(src.expected_hf_shape)} from config.json")
        sources[src.pmx_name] = (src, stored(hf))
        used.add(stored(hf))
    extra = sorted(n for n in ckpt.keys() if n not in used and not family.is_ignored(n))
    parts: dict = {}  # the parts of a multimodal checkpoint that are not converted: what -> tensor count
    for n in extra:
        what = family.left_out_part(n)
        if what is not None:
            parts[what] = parts.get(what, 0) + 1
    if parts:
        print(f"{input_dir}: not converted: " + ", ".join(f"the {what} ({k} tensors)" for what, k in parts.items()) +
              f"; pmx-runner runs its language model ({family.name}: text in, text out)", file=sys.stderr)
        extra = [n for n in extra if family.left_out_part(n) is None]
    if extra:
        raise PmxError(f"{input_dir}: unexpected tensor(s) not used by {family.name}: {extra[:8]}"
                       f"{' ...' if len(extra) > 8 else ''} ({len(extra)} in all); refusing to drop them silently")

    last: dict = {}  # the HF tensor read last: a fused one (q/k/v, gate/up) gives its parts one after the other
    scratch = Scratch()

    def read(hf: str) -> torch.Tensor:
        if hf not in last:
            last.clear()
            last[hf] = ckpt.get(hf)
        return last[hf]

    def fetch(name: str) -> torch.Tensor | Stored:
        """Tensor `name` as written: left in its file where it needs no change, else computed in reused memory."""
        src, hf = sources[name]
        if src.stacked:
            return torch.stack([ckpt.get(stored(n)) for n in src.stacked]).to(target)
        if src.take is not None:
            t = src.take(read(hf))
        else:
            t = ckpt.stored(hf)
            if not src.rotary_heads and t.dtype == target:
                return t
            t = as_tensor(t)
        if src.rotary_heads:
            t = unpermute_rotary(t, src.rotary_heads, out=scratch.take("rotary", t.dtype, t.shape),
                                 rotary_dims=src.rotary_dims)
        return t if t.dtype == target else scratch.take("cast", target, t.shape).copy_(t)

    plan = [(s.pmx_name, target, s.shape) for s, _ in sources.values()]
    extras = family.tokenizer_extras(Path(input_dir), params)
    return _write_dir(Path(input_dir), output_dir, overwrite, params, plan, fetch, num_shards, "converting", progress,
                      quant, extras)


def convert_gguf(files: list, output_dir: str, dtype: str = "auto", num_shards: int = 1, overwrite: bool = False,
                 progress: bool = True, quant: Optional[QuantScheme] = None,
                 report: Optional[Callable[[str], None]] = None, exact: tuple = tuple(EXACT)) -> PmxParams:
    """A GGUF model (runner/pmx/gguf.py: one file or a split set's parts, in order) -> a PMX directory: the family's
    params from llama.cpp's keys, its tensors by llama.cpp's names, the `exact` types (of Q8_0, Q4_0, Q4_1) kept as
    the same integers and scales, other quantised types dequantised (and re-quantised where `quant` asks), floats
    at the model's dtype."""
    ckpt = GGUFCheckpoint(files)
    source, tensors = str(ckpt.path), ckpt.tensors
    family = family_for_gguf(ckpt.architecture, "blk.0.ffn_gate_exps.weight" in tensors, source)
    shapes = {n: t.shape for n, t in tensors.items()}
    vectors = {n: ckpt.float_tensor(tensors[n]).float().tolist() for n in GGUF_READ_INTO_PARAMS if n in tensors}
    config = family.gguf_config(ckpt.meta, shapes, source, vectors)
    eos = eos_ids(ckpt.meta)
    config["eos_token_id"] = eos[0] if len(eos) == 1 else eos or None
    target_name = _gguf_dtype(dtype, ckpt)
    params = family.gguf_params(config, target_name, source)
    target = DTYPE_NAMES[target_name]

    sources, used = {}, set(GGUF_READ_INTO_PARAMS)
    for src in family.gguf_sources(params, set(tensors)):
        name = next((n for n in src.hf_names if n in tensors), None)
        if name is None:
            raise PmxError(f"{source}: missing tensor {src.hf_names[0]!r} (needed for {src.pmx_name})")
        if tuple(tensors[name].shape) != tuple(src.expected_hf_shape):
            raise PmxError(f"{ckpt.tensors[name].path}: tensor {name!r} has shape {list(tensors[name].shape)}, "
                           f"expected {list(src.expected_hf_shape)} from its metadata")
        sources[src.pmx_name] = (src, tensors[name])
        used.add(name)
    extra = sorted(set(tensors) - used)
    if extra:
        raise PmxError(f"{source}: unexpected tensor(s) not used by {family.name}: {extra[:8]}"
                       f"{' ...' if len(extra) > 8 else ''} ({len(extra)} in all); refusing to drop them silently")

    # each weight's stored form: the same integers and scales (an exact type), re-quantised (`quant`), or float
    leaves, kinds = {}, {}
    for name, (src, t) in sources.items():
        if not quantizable(name):
            kinds[t.name, _float_outcome(t.type, target)] = t.type
            continue
        if t.type in exact:
            leaf = EXACT[t.type]
            kinds[t.name, f"{leaf.describe()}, bit-exact"] = t.type
        else:
            leaf = None if quant is None else quant.for_tensor(name)
            kinds[t.name, _float_outcome(t.type, target) if leaf is None else
                  f"{leaf.describe()} ({'dequantised, ' if t.type not in FLOATS else ''}--quantize)"] = t.type
        leaves[name[: -len(".weight")]] = leaf
    scheme = QuantScheme.of_tensors(leaves)
    params = params.replace(quantization=None if scheme is None else scheme.to_dict())
    sharded_params(params, num_shards)  # fail before any work if the cut is impossible

    plan, pending, scratch = [], {}, Scratch()
    for name, (src, t) in sources.items():
        leaf = None if scheme is None else scheme.for_tensor(name)
        if leaf is None:
            plan.append((name, target, src.shape))
            continue
        base = name[: -len(".weight")]
        plan += [(f"{base}.{part}", leaf.qdtype if part == "qweight" else torch.float32,
                  leaf.qshape(src.shape) if part == "qweight" else leaf.scale_shape(src.shape))
                 for part in quant_parts(leaf)]

    def rows(src, x: torch.Tensor) -> torch.Tensor:
        """This tensor's rows (of a weight, its scales, its offsets): its part of a fused tensor, q/k rows from
        rotate-half to interleaved pairs where stored so."""
        x = x if src.take is None else src.take(x)
        return unpermute_rotary(x, src.rotary_heads, rotary_dims=src.rotary_dims) if src.rotary_heads else x

    def fetch(name: str) -> torch.Tensor | Stored:
        if name in pending:
            return pending.pop(name)
        base, _, part = name.rpartition(".")
        if part not in QUANT_PARTS:
            src, t = sources[name]
            if t.type in FLOATS and FLOATS[t.type] == target and not src.rotary_heads and src.take is None:
                return Stored.of_file(t.path, t.offset, target, t.shape)  # copied file to file
            x = rows(src, ckpt.float_tensor(t))
            return x if x.dtype == target else scratch.take("cast", target, x.shape).copy_(x)
        src, t = sources[f"{base}.weight"]
        leaf = scheme.for_tensor(f"{base}.weight")
        parts = ckpt.exact_parts(t) if t.type in exact else quantize(rows(src, ckpt.float_tensor(t)).float(), leaf)
        if t.type in exact:
            parts = tuple(rows(src, x) for x in parts)
        got = dict(zip(quant_parts(leaf), parts))
        pending.update({f"{base}.{p}": x for p, x in got.items() if p != part})
        return got[part]

    if report is not None:
        for line in _type_lines(kinds):
            report(line)
    extras, eos = tokenizer_files(ckpt, params.max_position_embeddings)
    params = params.replace(eos_token_id=eos[0] if len(eos) == 1 else eos or None)
    # checked apart from the file itself (an output beside it in its directory is fine; one holding it is not)
    return _write_dir(ckpt.path, output_dir, overwrite, params, plan, fetch, num_shards, "converting", progress,
                      None, extras, copy_tokenizer=False)


def _float_outcome(type_name: str, target: torch.dtype) -> str:
    """What a tensor of GGUF type `type_name` kept float becomes."""
    return DTYPE_OF[target] + ("" if type_name in FLOATS else " (dequantised)")


def _type_lines(kinds: dict) -> list[str]:
    """One line per GGUF type: how many of its tensors came in, and what they were written as (`kinds`: (GGUF tensor,
    what it was written as) -> its type; a tied embedding is written twice, as the embedding and the lm head)."""
    from collections import Counter
    count = Counter((type_name, out) for (_, out), type_name in kinds.items())
    lines = []
    for type_name in sorted({t for t, _ in count}, key=lambda t: -sum(n for (u, _), n in count.items() if u == t)):
        outs = [(n, out) for (u, out), n in count.items() if u == type_name]
        total = sum(n for n, _ in outs)
        what = "; ".join(out if len(outs) == 1 else f"{n} -> {out}" for n, out in sorted(outs, reverse=True))
        lines.append(f"{type_name}: {total} tensor{'s' if total > 1 else ''} -> {what}")
    return lines


def _gguf_dtype(dtype: str, ckpt: GGUFCheckpoint) -> str:
    """--dtype auto of a GGUF: the width of the matrices it stores as floats (the widest where they differ); float32
    where every matrix is quantised (its norms are float32)."""
    if dtype != "auto":
        if dtype not in DTYPE_NAMES:
            raise PmxError(f"--dtype {dtype!r} is not one of auto, {', '.join(DTYPE_NAMES)}")
        return dtype
    widths = {FLOATS[t.type] for t in ckpt.tensors.values() if t.type in FLOATS and len(t.shape) >= 2}
    return DTYPE_OF[widths.pop()] if len(widths) == 1 else "float32"


def with_quant(params: PmxParams, quant: Optional[QuantScheme]) -> PmxParams:
    return params if quant is None else params.replace(quantization=quant.to_dict())


def _convert_ppl(input_dir: Path, params_file: Path, output_dir: str, dtype: str, num_shards: int, overwrite: bool,
                 progress: bool, quant: Optional[QuantScheme]) -> PmxParams:
    """ppl.pmx's opmx_params.json + model.pth -> PMX (same tensor names and q/k layout)."""
    pth = input_dir / "model.pth"
    if not pth.is_file():
        split = sorted(p.name for p in input_dir.glob("model.*.pth"))
        raise PmxError(f"{pth}: not found" + (f"; {input_dir} holds split ppl.pmx shards {split[:3]}: merge them with "
                                              f"ppl.pmx's Merge.py first" if split else ""))
    tensors = BinFile(pth)
    params = ppl_params(params_file, tensors, dtype)
    check_tensors(params, tensors)
    sharded_params(with_quant(params, quant), num_shards)
    target = DTYPE_NAMES[params.dtype]
    plan = [(n, target, shape) for n, shape in pmx_tensors(params).items()]
    return _write_dir(input_dir, output_dir, overwrite, params, plan, lambda n: tensors.get(n).to(target), num_shards,
                      "converting", progress, quant)


def _resolve_dtype(dtype: str, ckpt: HFCheckpoint) -> str:
    if dtype != "auto":
        if dtype not in DTYPE_NAMES:
            raise PmxError(f"--dtype {dtype!r} is not one of auto, {', '.join(DTYPE_NAMES)}")
        return dtype
    cfg = ckpt.config.get("torch_dtype") or ckpt.config.get("dtype")
    if cfg in DTYPE_NAMES:
        return cfg
    first = next((ckpt.dtype(n) for n in ckpt.keys() if ckpt.dtype(n).is_floating_point), torch.float32)
    return dtype_name(first)


class PmxModel:
    """A PMX directory opened for reading: its params and lazily read (merged) tensors."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.params = PmxParams.load(self.dir)
        self.readers = [SafetensorsReader(self.dir / shard_file(r)) for r in range(self.params.num_shards)]
        extra = sorted(p.name for p in self.dir.glob("model.*.safetensors")
                       if p.name not in {shard_file(r) for r in range(self.params.num_shards)})
        if extra:
            raise PmxError(f"{self.dir}: holds {extra}, but pmx_params.json says num_shards={self.params.num_shards}")
        check_shards(dict(enumerate(self.readers)), self.params.num_shards)
        keys = self.readers[0].keys()
        for r, rd in enumerate(self.readers[1:], 1):
            if rd.keys() != keys:
                raise PmxError(f"{rd.path}: holds tensors {sorted(set(rd.keys()) ^ set(keys))[:4]} that "
                               f"{self.readers[0].path} does not (or the other way round)")
        self.keys = keys

    def full_shape(self, name: str) -> tuple:
        """Unsplit shape of `name`, checked against every shard's part."""
        p = self.params
        full = full_shape(p, name, self.readers[0].shape(name))
        for rd in self.readers:
            if tuple(rd.shape(name)) != shard_shape(p, name, full):
                raise PmxError(f"{rd.path}: tensor {name!r} has shape {list(rd.shape(name))}, expected "
                               f"{list(shard_shape(p, name, full))} for a {p.num_shards}-way shard")
        return full

    def merged(self, name: str) -> Stored:
        """Unsplit tensor `name` left in the shard files (runner/pmx/stored.py); replicas checked equal."""
        return merge_tensor(self.params, name, [rd.stored(name) for rd in self.readers])

    def get_merged(self, name: str) -> torch.Tensor:
        return self.merged(name).tensor()


def reshard(input_dir: str, output_dir: str, num_shards: int, overwrite: bool = False,
            progress: bool = True, expect_input_shards: Optional[int] = None) -> PmxParams:
    """Rewrites a PMX directory with `num_shards` shards (split: N > 1, merge: N = 1), bit for bit."""
    model = PmxModel(Path(input_dir))
    p = model.params
    if expect_input_shards is not None and expect_input_shards != p.num_shards:
        raise PmxError(f"{input_dir}: --num_shards {expect_input_shards} given, but the model there has "
                       f"num_shards={p.num_shards} (pmx_params.json)")
    sharded_params(unsharded_params(p), num_shards)
    plan = _read_plan(model, input_dir)
    return _write_dir(Path(input_dir), output_dir, overwrite, p, plan, model.merged, num_shards,
                      "merging" if num_shards == 1 else "splitting", progress)


def _read_plan(model: PmxModel, input_dir) -> Plan:
    """(name, dtype, unsplit shape) of every tensor of `model`, in file order, checked against its params:
    every expected tensor and no other, their dtypes (quantised ones their scheme's) and unsplit shapes."""
    p, plan = model.params, []
    expected = pmx_tensors(p)
    first = model.readers[0].path
    missing, extra = sorted(set(expected) - set(model.keys)), sorted(set(model.keys) - set(expected))
    if missing or extra:
        raise PmxError(f"{first}: its tensors do not match {input_dir}/pmx_params.json: missing {missing[:4]}, "
                       f"unexpected {extra[:4]} (was pmx_params.json edited?)")
    for name in model.keys:
        got, dt = model.readers[0].dtype(name), tensor_dtype(p, name, DTYPE_NAMES[p.dtype])
        if got != dt:
            what = "its quantisation" if is_quant_tensor(name) else "pmx_params dtype"
            raise PmxError(f"{first}: tensor {name!r} is {got}, expected {dt} ({what})")
        shape = model.full_shape(name)
        if tuple(shape) != tuple(expected[name]):
            raise PmxError(f"{first}: tensor {name!r} is {list(shape)} unsplit, but {input_dir}/pmx_params.json "
                           f"gives {list(expected[name])} (was pmx_params.json edited?)")
        plan.append((name, dt, shape))
    return plan


def quantize_model(input_dir: str, output_dir: str, quant: QuantScheme, num_shards: Optional[int] = None,
                   overwrite: bool = False, progress: bool = True) -> PmxParams:
    """Writes a weight-only quantised copy of the float PMX model in `input_dir` (split as it is, or into
    `num_shards`). Each weight is merged, quantised whole (so a row-parallel int8 scale covers the full row)
    and cut again, one tensor at a time."""
    model = PmxModel(Path(input_dir))
    p = model.params
    if p.quantization is not None:
        raise PmxError(f"{input_dir}: is already quantised ({p.quantization}); quantise its float model")
    n = p.num_shards if num_shards is None else num_shards
    sharded_params(with_quant(unsharded_params(p), quant), n)
    return _write_dir(Path(input_dir), output_dir, overwrite, p, _read_plan(model, input_dir), model.get_merged, n,
                      "quantizing", progress, quant)
