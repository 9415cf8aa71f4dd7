"""Reading ppl.pmx's own exports: `opmx_params.json` (older versions: a `pmx_params.json` of the same
keys) beside an unsplit `model.pth`, as its ConvertWeightToOpmx.py / ConvertWeightToPmx.py write them.

The tensor names and the interleaved q/k rows are already PMX's, so conversion only completes the
params (dtype, biases and sizes read off the tensors), checks every tensor strictly, and writes
safetensors shards. The `.pth` is loaded with `weights_only=True` and memory-mapped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from runner.errors import PmxError
from runner.pmx.params import PARAMS_FILE, PmxParams
from runner.pmx.schema import pmx_tensors
from runner.pmx.store import DTYPE_NAMES, dtype_name

PPL_PARAMS_FILES = ("opmx_params.json", PARAMS_FILE)
PPL_KEYS = {"hidden_dim", "num_heads", "num_layers", "norm_eps", "vocab_size", "num_kv_heads", "head_dim",
            "intermediate_dim", "max_position_embeddings", "rope_theta", "multiple_of", "ffn_dim_multiplier"}
DEFAULT_MAX_POSITIONS = 2048  # ppl.pmx's params carry it only when the HF config had it


def find_ppl_params(directory: Path) -> Optional[Path]:
    """The params file of a ppl.pmx export in `directory`, or None (a HF directory or one of ours)."""
    d = Path(directory)
    if (d / "config.json").is_file():
        return None
    for name in PPL_PARAMS_FILES:
        path = d / name
        if path.is_file():
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise PmxError(f"{path}: not valid JSON ({e})") from None
            if isinstance(data, dict) and "format_version" not in data:  # ours always record it
                return path
    return None


def ppl_params(path: Path, tensors, dtype: str) -> PmxParams:
    """PmxParams of a ppl.pmx export: its params file, completed from the tensors `tensors` (a BinFile)."""
    raw = json.loads(Path(path).read_text())
    unknown = sorted(set(raw) - PPL_KEYS)
    if unknown:
        raise PmxError(f"{path}: unknown key(s) {unknown}; a ppl.pmx params file has only {sorted(PPL_KEYS)}")
    missing = sorted({"hidden_dim", "num_heads", "num_layers", "norm_eps", "vocab_size"} - set(raw))
    if missing:
        raise PmxError(f"{path}: missing required key(s) {missing}")
    names = set(tensors.keys())
    if "tok_embeddings.weight" not in names:
        raise PmxError(f"{tensors.path}: holds no tok_embeddings.weight; not a ppl.pmx model")
    if dtype == "auto":
        dtype = dtype_name(tensors.dtype("tok_embeddings.weight"))
    elif dtype not in DTYPE_NAMES:
        raise PmxError(f"--dtype {dtype!r} is not one of auto, {', '.join(DTYPE_NAMES)}")
    heads = int(raw["num_heads"])
    inter = raw.get("intermediate_dim")
    if inter is None and "layers.0.feed_forward.w1.weight" in names:
        inter = tensors.shape("layers.0.feed_forward.w1.weight")[0]
    if inter is None:
        raise PmxError(f"{path}: no intermediate_dim, and {tensors.path} has no layers.0.feed_forward.w1.weight")
    return PmxParams(
        model_type="llama", architecture="ppl.pmx", hidden_dim=int(raw["hidden_dim"]), intermediate_dim=int(inter),
        num_layers=int(raw["num_layers"]), num_heads=heads, num_kv_heads=int(raw.get("num_kv_heads", heads)),
        head_dim=int(raw.get("head_dim", int(raw["hidden_dim"]) // heads)), vocab_size=int(raw["vocab_size"]),
        norm_eps=float(raw["norm_eps"]), rope_theta=float(raw.get("rope_theta", 10000.0)),
        max_position_embeddings=int(raw.get("max_position_embeddings", DEFAULT_MAX_POSITIONS)), dtype=dtype,
        qkv_bias="layers.0.attention.wq.bias" in names, o_bias="layers.0.attention.wo.bias" in names,
        ffn_bias="layers.0.feed_forward.w1.bias" in names)


def check_tensors(params: PmxParams, tensors) -> None:
    """Exactly the tensors the params call for, in their shapes."""
    want = pmx_tensors(params)
    have = set(tensors.keys())
    missing, extra = sorted(set(want) - have), sorted(have - set(want))
    if missing or extra:
        raise PmxError(f"{tensors.path}: tensors do not match the params: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, shape in want.items():
        if tuple(tensors.shape(name)) != tuple(shape):
            raise PmxError(f"{tensors.path}: tensor {name!r} has shape {list(tensors.shape(name))}, expected {list(shape)}")
