"""`pmx_params.json`: every hyper-parameter the engine needs, nothing implicit.

The file is the contract between conversion, split/merge and the engine (PMX format version 1,
README.md "The PMX format"). Loading is strict: a missing required key, an unknown key or a value of the wrong
type is an error naming the file and the key.

Keys added to version 1 later (position_embedding, rotary_dim, logn_scaling) default to what a file without them
meant (rotary over all of head_dim, no logn scaling), so older files load unchanged; conversion writes them all.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from runner.errors import PmxError
from runner.pmx.quant import QuantScheme

FORMAT_VERSION = 1
PARAMS_FILE = "pmx_params.json"
DTYPES = ("float32", "float16", "bfloat16")
POSITION_EMBEDDINGS = ("rotary", "alibi")


@dataclass(frozen=True)
class PmxParams:
    model_type: str                      # family name, informational only (the engine never branches on it)
    hidden_dim: int
    intermediate_dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    dtype: str
    rope_scaling: Optional[dict] = None  # null or the HF dict, as it was in config.json
    position_embedding: str = "rotary"   # "rotary" (q, k rotated) or "alibi" (a linear bias per head on the scores)
    rotary_dim: Optional[int] = None     # dims of each head rotated, in interleaved pairs from the first (the rest pass
                                         # through); null: all head_dim (files written before the key); 0 with alibi
    logn_scaling: Optional[int] = None   # L: q at position p scaled by log(p + 1) / log(L) where p + 1 > L; null: off
    qkv_bias: bool = False
    o_bias: bool = False
    ffn_bias: bool = False
    qk_norm: bool = False                # per-head RMSNorm of q and k before rotary (Qwen3)
    sliding_window: Optional[int] = None
    num_experts: int = 0
    num_experts_per_token: int = 0
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Union[int, list, None] = None
    pad_token_id: Optional[int] = None
    architecture: str = ""               # the HF architecture the model came from
    num_shards: int = 1
    kv_replication: int = 1              # each KV head is stored on this many ranks (num_kv_heads < num_shards)
    padded_dims: dict = field(default_factory=dict)  # logical dim -> padded size, e.g. {"intermediate_dim": 176}
    quantization: Optional[dict] = None  # null (float weights) or a weight-only scheme, see runner/pmx/quant.py
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.format_version != FORMAT_VERSION:
            raise PmxError(f"unsupported PMX format_version {self.format_version}; this runner reads {FORMAT_VERSION}")
        if self.dtype not in DTYPES:
            raise PmxError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        for name in ("hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "vocab_size", "num_shards", "kv_replication"):
            if getattr(self, name) <= 0:
                raise PmxError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise PmxError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.quantization is not None:
            QuantScheme.from_dict(self.quantization, "quantization")
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise PmxError(f"position_embedding must be one of {', '.join(POSITION_EMBEDDINGS)}, got "
                           f"{self.position_embedding!r}")
        rd = self.rotary_dims
        if self.position_embedding == "alibi" and rd != 0:
            raise PmxError(f"rotary_dim must be 0 with position_embedding alibi, got {self.rotary_dim}")
        if self.position_embedding == "rotary" and not (isinstance(rd, int) and 0 < rd <= self.head_dim
                                                        and rd % 2 == 0):
            raise PmxError(f"rotary_dim must be an even number in [2, head_dim={self.head_dim}] (or null: all of "
                           f"head_dim), got {self.rotary_dim!r}")
        if self.logn_scaling is not None and not (isinstance(self.logn_scaling, int) and self.logn_scaling > 1):
            raise PmxError(f"logn_scaling must be null or an integer > 1, got {self.logn_scaling!r}")

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def rotary_dims(self) -> int:
        """The dims of each head that rotary rotates (0: none, ALiBi)."""
        if self.rotary_dim is None:
            return 0 if self.position_embedding == "alibi" else self.head_dim
        return self.rotary_dim

    def padded(self, dim: str) -> int:
        """The size of logical dim `dim` as stored in the shards (after split padding)."""
        return self.padded_dims.get(dim, getattr(self, dim))

    @property
    def eos_ids(self) -> tuple:
        e = self.eos_token_id
        return () if e is None else tuple(e) if isinstance(e, (list, tuple)) else (e,)

    # -- (de)serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "PmxParams":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, d: dict, source: str = "pmx_params") -> "PmxParams":
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(fields))
        if unknown:
            raise PmxError(f"{source}: unknown key(s) {unknown}; expected only {sorted(fields)}")
        missing = sorted(n for n, f in fields.items()
                         if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and n not in d)
        if missing:
            raise PmxError(f"{source}: missing required key(s) {missing}")
        try:
            return cls(**d)
        except TypeError as e:
            raise PmxError(f"{source}: {e}") from None

    def save(self, directory: Path) -> None:
        path = Path(directory) / PARAMS_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, directory: Path) -> "PmxParams":
        """From a PMX directory, or from a params file given directly (e.g. for random-weight benchmarks)."""
        path = Path(directory)
        path = path if path.suffix == ".json" and not path.is_dir() else path / PARAMS_FILE
        if not path.is_file():
            raise PmxError(f"{path}: not found; a PMX directory holds {PARAMS_FILE} and model.XX.safetensors")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise PmxError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise PmxError(f"{path}: expected a JSON object")
        return cls.from_dict(d, source=str(path))


def shard_file(rank: int) -> str:
    """File name of shard `rank` in a PMX directory."""
    return f"model.{rank:02d}.safetensors"
