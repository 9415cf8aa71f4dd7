"""Weight-only quantisation of PMX models: the scheme, the arithmetic (the spec every kernel is tested
against) and the tensor layout of a quantised model.

Schemes (recorded as `quantization` in pmx_params.json):

- **int8**: symmetric, one scale per output channel. `scale[n] = max_k |W[n, k]| / 127`,
  `q = round(W / scale)` in [-127, 127]; dequantised `W ~ q * scale[n]`.
- **int4**: symmetric, one scale per group of `group_size` consecutive input columns, as ppl.pmx's
  `pseudo_quantize_tensor(zero_point=False)` (`q = clamp(round(W / scale), -8, 7)`), stored as the nibble
  `q + 8`, two per byte along the input dim (column 2j in the low nibble of byte j, 2j+1 in the high one);
  dequantised `W ~ (nibble - 8) * scale`. Where ppl.pmx takes `scale = max|W| / 7`, each group's scale here
  is the one of `max|W| / 7 * f`, f in INT4_SCALE_SEARCH, with the least squared error over the group
  (about 20% less error on the real checkpoints: clipping the largest weight a little rounds the rest better).

Names follow ppl.pmx's weight-only-quantised (woqu) layers: a quantised `X.weight` [.., N, K] becomes
`X.qweight` (int8 [.., N, K], or uint8 [.., N, K/2] for int4: the bytes of ppl.pmx's int32 column
packing `ModelQuantUtils.pack(direction="column")` read little-endian) and `X.scale` (float32 [.., N]
for int8, [.., N, K/group_size] for int4); a bias stays `X.bias`. There is no zero point (symmetric).
Quantised: the linear weights of attention (wq wk wv wo), the MLP (w1 w2 w3) and MoE experts; `output` and
the token embedding `tok_embeddings` [V, D] unless turned off (`quantize_output`, `quantize_embedding`), the
embedding as a weight of V rows over D input columns: a row's scale (int8) or its groups of hidden columns
(int4), dequantised as its rows are gathered. Norms and the MoE router stay float.

Format history: `quantize_embedding` came later; a `quantization` without it (or without `quantize_output`) is a
model whose embedding (output) is float, and reads as it did.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from runner.errors import PmxError
from runner.pmx.stored import as_tensor

METHODS = ("int8", "int4")
QUANTIZABLE = re.compile(r"layers\.\d+\.(attention\.(wq|wk|wv|wo)|feed_forward\.(w1|w2|w3))")
INT8_MAX, INT4_MIN, INT4_MAX = 127, -8, 7
INT4_SCALE_SEARCH = tuple(round(0.6 + 0.025 * i, 3) for i in range(23))  # 0.6 .. 1.15


@dataclass(frozen=True)
class QuantScheme:
    method: str                     # "int8" (per output channel) or "int4" (groups along the input dim)
    group_size: int = 0             # int4: columns per scale; 0 for int8
    quantize_output: bool = True    # the lm head `output.weight` too
    quantize_embedding: bool = True  # the token embedding `tok_embeddings.weight` too

    def __post_init__(self):
        if self.method not in METHODS:
            raise PmxError(f"quantization method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.method == "int8" and self.group_size != 0:
            raise PmxError(f"int8 quantisation is per output channel: group_size must be 0, got {self.group_size}")
        if self.method == "int4" and (not isinstance(self.group_size, int) or self.group_size < 2
                                      or self.group_size % 2):
            raise PmxError(f"int4 group_size must be a positive even integer, got {self.group_size!r}")

    @classmethod
    def from_dict(cls, d: dict, source: str = "pmx_params quantization") -> "QuantScheme":
        """The scheme a pmx_params.json records; a flag it does not record is off (written before it existed)."""
        known = {"method", "group_size", "quantize_output", "quantize_embedding"}
        if not isinstance(d, dict) or set(d) - known or "method" not in d:
            raise PmxError(f"{source}: expected an object with 'method' and optionally 'group_size', "
                           f"'quantize_output', 'quantize_embedding'; got {d!r}")
        return cls(**{"quantize_output": False, "quantize_embedding": False, **d})

    def to_dict(self) -> dict:
        return asdict(self)

    def quantizes(self, name: str) -> bool:
        """Whether float tensor `name` (a `.weight`) is stored quantised under this scheme."""
        base, _, leaf = name.rpartition(".")
        return leaf == "weight" and (bool(QUANTIZABLE.fullmatch(base)) or (self.quantize_output and base == "output")
                                     or (self.quantize_embedding and base == "tok_embeddings"))

    def qshape(self, shape: tuple) -> tuple:
        """Shape of `qweight` for a float weight of `shape` [.., N, K]."""
        return (*shape[:-1], shape[-1] // 2) if self.method == "int4" else tuple(shape)

    def scale_shape(self, shape: tuple) -> tuple:
        return (*shape[:-1], shape[-1] // self.group_size) if self.method == "int4" else tuple(shape[:-1])

    @property
    def qdtype(self) -> torch.dtype:
        return torch.uint8 if self.method == "int4" else torch.int8


def is_matrix_weight(name: str) -> bool:
    """Whether float tensor `name` is a linear layer's weight, the output's or the embedding's: what a weight-only
    scheme can quantise, and what a CPU engine computing in float32 keeps in a half-precision checkpoint's width."""
    base, _, leaf = name.rpartition(".")
    return leaf == "weight" and (bool(QUANTIZABLE.fullmatch(base)) or base in ("output", "tok_embeddings"))


def scheme_of(params) -> Optional[QuantScheme]:
    """The QuantScheme of PmxParams `params`, or None for a float model."""
    q = params.quantization
    return None if q is None else QuantScheme.from_dict(q)


# -- arithmetic: the spec ------------------------------------------------------------------------

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [.., N, K] -> (q int8 [.., N, K], scale float32 [.., N]); all-zero rows get scale 0."""
    w = w.float()
    scale = w.abs().amax(-1) / INT8_MAX
    q = torch.round(w / torch.where(scale == 0, 1.0, scale)[..., None]).clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [.., N, K] -> (packed uint8 [.., N, K/2], scale float32 [.., N, K/group_size])."""
    *lead, n, k = w.shape
    if k % group_size:
        raise PmxError(f"int4 needs the input dim ({k}) to be a multiple of group_size {group_size}")
    g = w.float().reshape(*lead, n, k // group_size, group_size)
    amax = g.abs().amax(-1) / INT4_MAX

    def rounded(scale):
        return torch.round(g / torch.where(scale == 0, 1.0, scale)[..., None]).clamp_(INT4_MIN, INT4_MAX)

    scale, best = amax, None
    for f in INT4_SCALE_SEARCH:  # per group, the scale with the least squared error
        s = amax * f
        err = (rounded(s) * s[..., None] - g).square_().sum(-1)
        if best is None:
            scale, best = s, err
        else:
            better = err < best
            scale, best = torch.where(better, s, scale), torch.where(better, err, best)
    q = rounded(scale)
    return pack_int4((q + 8).to(torch.uint8).reshape(*lead, n, k)), scale


def pack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [.., K] -> bytes [.., K/2]: column 2j low nibble, 2j+1 high nibble."""
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 [.., K/2] -> nibbles 0..15 as uint8 [.., K]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, method: str, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """The float weight [.., N, K] that (qweight, scale) stands for; computed in float32, then cast."""
    if method == "int8":
        return (qweight.float() * scale.float()[..., None]).to(dtype)
    q = unpack_int4(qweight).float() - 8                                           # (.., N, K)
    groups = scale.shape[-1]
    w = q.unflatten(-1, (groups, -1)) * scale.float()[..., None]                   # (.., N, G, group)
    return w.flatten(-2).to(dtype)


def quantize(w: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_int8(w) if scheme.method == "int8" else quantize_int4(w, scheme.group_size)


# -- layout of a quantised model -----------------------------------------------------------------

def quantized_tensors(scheme: QuantScheme, tensors: dict) -> dict:
    """{name: unsplit shape} of a float model -> the same with each quantised weight replaced, in place in
    the order, by its `qweight` and `scale`."""
    out = {}
    if scheme.method == "int4":
        _check_group_size(scheme.group_size, {n: s for n, s in tensors.items() if scheme.quantizes(n)})
    for name, shape in tensors.items():
        if scheme.quantizes(name):
            base = name[: -len(".weight")]
            out[f"{base}.qweight"] = scheme.qshape(shape)
            out[f"{base}.scale"] = scheme.scale_shape(shape)
        else:
            out[name] = shape
    return out


def _check_group_size(group_size: int, weights: dict) -> None:
    """Every quantised weight's input dim must hold whole groups; the error lists every group size that would
    do (the even divisors of the input dims' greatest common divisor), so none is found one failure at a time."""
    bad = next((n for n, shape in weights.items() if shape[-1] % group_size), None)
    if bad is None:
        return
    common = math.gcd(*(shape[-1] for shape in weights.values()))
    fits = [g for g in range(2, common + 1, 2) if common % g == 0]
    hint = (f"group sizes that divide every input dim: {', '.join(map(str, fits))}" if fits else
            f"no int4 group size divides every input dim (their common divisor is {common}); use --quantize int8")
    raise PmxError(f"int4 with group_size {group_size}: tensor {bad!r} has input dim {weights[bad][-1]}, not a "
                   f"multiple of it; {hint}")


def tensor_dtype(params, name: str, float_dtype: torch.dtype) -> torch.dtype:
    """Stored dtype of tensor `name` of a model with params `params` (float tensors: `float_dtype`)."""
    scheme = scheme_of(params)
    if scheme is not None and name.endswith(".qweight"):
        return scheme.qdtype
    if scheme is not None and name.endswith(".scale"):
        return torch.float32
    return float_dtype


def is_quant_tensor(name: str) -> bool:
    return name.endswith(".qweight") or name.endswith(".scale")


def scheme_from_flags(quantize: Optional[str], group_size: int = 128, quantize_output: Optional[bool] = None,
                      quantize_embedding: Optional[bool] = None) -> Optional[QuantScheme]:
    """The scheme the command-line flags ask for (None: keep float), with errors naming the flag. The output and
    the embedding are quantised unless their flag says False."""
    if quantize in (None, "", "none"):
        for flag, value in (("--quantize_output", quantize_output), ("--quantize_embedding", quantize_embedding)):
            if value:
                raise PmxError(f"{flag} needs --quantize int8 or int4")
        return None
    if quantize not in METHODS:
        raise PmxError(f"--quantize must be int8 or int4, got {quantize!r}")
    if quantize == "int4" and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2
                               or group_size % 2):
        raise PmxError(f"--group_size must be a positive even integer, got {group_size!r}")
    for flag, value in (("--quantize_output", quantize_output), ("--quantize_embedding", quantize_embedding)):
        if value is not None and not isinstance(value, bool):
            raise PmxError(f"{flag} must be True or False, got {value!r}")
    return QuantScheme(quantize, group_size if quantize == "int4" else 0, quantize_output is not False,
                       quantize_embedding is not False)


def quantizing_fetch(scheme: QuantScheme, plan, fetch):
    """A float model's write plan [(name, dtype, shape)] and `fetch(name)` -> the quantised model's plan and
    fetch: each quantised `X.weight` becomes `X.qweight` then `X.scale`, computed from one read of the weight
    (the scale is held until it is asked for, next)."""
    out, pending = [], {}
    for name, dtype, shape in plan:
        if scheme.quantizes(name):
            base = name[: -len(".weight")]
            out += [(f"{base}.qweight", scheme.qdtype, scheme.qshape(shape)),
                    (f"{base}.scale", torch.float32, scheme.scale_shape(shape))]
        else:
            out.append((name, dtype, shape))
    quantized_tensors(scheme, {n: s for n, _, s in plan})  # refuses shapes the scheme cannot take, up front

    def fetch_q(name: str) -> torch.Tensor:
        base, _, leaf = name.rpartition(".")
        if leaf == "qweight":
            q, pending[base] = quantize(as_tensor(fetch(f"{base}.weight")), scheme)
            return q
        if leaf == "scale" and base in pending:
            return pending.pop(base)
        return fetch(name)
    return out, fetch_q
