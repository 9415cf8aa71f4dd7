"""`pmx_params.json`: every hyper-parameter the engine needs, nothing implicit.

The file is the contract between conversion, split/merge and the engine (PMX format version 1,
README.md "The PMX format"). Loading is strict: a missing required key, an unknown key or a value of the wrong
type is an error naming the file and the key.

Keys added to version 1 later (position_embedding, rotary_dim, logn_scaling, layer_types, the sliding layers' rope,
norm_offset, post_norms, embedding_scale, attention_scale, the soft caps) default to what a file without them meant
(rotary over all of head_dim, no logn scaling, every layer of one kind, plain RMSNorm, no cap), so older files load
unchanged; conversion writes them all.
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
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")   # the MLP's gate activation: SwiGLU, GeGLU with tanh's GELU
LAYER_TYPES = ("full_attention", "sliding_attention")


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
    sliding_window: Optional[int] = None  # the window of the sliding layers (a query sees the last this many positions)
    layer_types: Optional[list] = None   # each layer's "full_attention" or "sliding_attention"; null: every layer
                                         # slides where sliding_window is set (files written before the key)
    sliding_rope_theta: Optional[float] = None  # the sliding layers' rope (theta, and scaling: null, the default
    sliding_rope_scaling: Optional[dict] = None  # one) where it differs from the full ones'; null theta: the same
    norm_offset: float = 0.0             # every RMSNorm multiplies by norm_offset + weight (Gemma's 1 + w)
    post_norms: bool = False             # the attention's and the MLP's outputs RMS-normed before the residual add
    embedding_scale: float = 1.0         # the token embeddings multiplied by this (Gemma's sqrt(hidden_dim))
    attention_scale: Optional[float] = None  # the scores' scale (null: head_dim ** -0.5)
    attn_logit_softcapping: Optional[float] = None   # scores capped to cap * tanh(scores / cap) (null: not capped)
    final_logit_softcapping: Optional[float] = None  # the logits likewise
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
        if self.hidden_act not in HIDDEN_ACTS:
            raise PmxError(f"hidden_act must be one of {', '.join(HIDDEN_ACTS)}, got {self.hidden_act!r}")
        if self.sliding_window is not None and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
            raise PmxError(f"sliding_window must be null or a positive integer, got {self.sliding_window!r}")
        if self.layer_types is not None:
            if (not isinstance(self.layer_types, list) or len(self.layer_types) != self.num_layers
                    or any(t not in LAYER_TYPES for t in self.layer_types)):
                raise PmxError(f"layer_types must be null or a list of num_layers={self.num_layers} values of "
                               f"{', '.join(LAYER_TYPES)}, got {self.layer_types!r}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise PmxError("layer_types has sliding_attention layers but sliding_window is null")
        for name in ("attention_scale", "attn_logit_softcapping", "final_logit_softcapping", "sliding_rope_theta"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise PmxError(f"{name} must be null or a positive number, got {v!r}")
        if not isinstance(self.embedding_scale, (int, float)) or not self.embedding_scale > 0:
            raise PmxError(f"embedding_scale must be a positive number, got {self.embedding_scale!r}")

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def rotary_dims(self) -> int:
        """The dims of each head that rotary rotates (0: none, ALiBi)."""
        if self.rotary_dim is None:
            return 0 if self.position_embedding == "alibi" else self.head_dim
        return self.rotary_dim

    def layer_window(self, i: int) -> int:
        """The sliding window of layer i (0: it attends to every position)."""
        if self.sliding_window is None or (self.layer_types is not None
                                           and self.layer_types[i] != "sliding_attention"):
            return 0
        return self.sliding_window

    def layer_rope(self, i: int) -> tuple[float, Optional[dict]]:
        """(theta, scaling) of layer i's rope."""
        if self.sliding_rope_theta is not None and self.layer_window(i):
            return self.sliding_rope_theta, self.sliding_rope_scaling
        return self.rope_theta, self.rope_scaling

    @property
    def uniform_window(self) -> Optional[int]:
        """The window every layer has (None: full attention everywhere, or layers of both kinds)."""
        windows = {self.layer_window(i) for i in range(self.num_layers)}
        return (windows.pop() or None) if len(windows) == 1 else None

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
