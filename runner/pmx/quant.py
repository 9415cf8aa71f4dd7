"""Weight-only quantisation of PMX models: the scheme, the arithmetic (the spec every kernel is tested
against) and the tensor layout of a quantised model.

Schemes (recorded as `quantization` in pmx_params.json):

- **int8**: symmetric. `group_size` 0: one scale per output channel, `scale[n] = max_k |W[n, k]| / 127`,
  `q = round(W / scale)` in [-127, 127]; dequantised `W ~ q * scale[n]`. `group_size` G > 0: one scale per group of
  G consecutive input columns (GGUF's Q8_0 is G = 32), dequantised `W ~ q * scale[n, k / G]`.
- **int4**: one scale per group of `group_size` consecutive input columns, stored as nibbles, two per byte along the
  input dim (column 2j in the low nibble of byte j, 2j+1 in the high one). Symmetric (the default), as ppl.pmx's
  `pseudo_quantize_tensor(zero_point=False)`: `q = clamp(round(W / scale), -8, 7)` stored as the nibble `q + 8`,
  dequantised `W ~ (nibble - 8) * scale`; where ppl.pmx takes `scale = max|W| / 7`, each group's scale here is the
  one of `max|W| / 7 * f`, f in INT4_SCALE_SEARCH, with the least squared error over the group (about 20% less error
  on the real checkpoints: clipping the largest weight a little rounds the rest better). With `offset` (GGUF's Q4_1;
  read from GGUF files, `--quantize` does not make it), each group also has an offset: `W ~ nibble * scale + offset`.

Names follow ppl.pmx's weight-only-quantised (woqu) layers: a quantised `X.weight` [.., N, K] becomes
`X.qweight` (int8 [.., N, K], or uint8 [.., N, K/2] for int4: the bytes of ppl.pmx's int32 column
packing `ModelQuantUtils.pack(direction="column")` read little-endian) and `X.scale` (float32 [.., N]
for per-channel int8, [.., N, K/group_size] for groups), plus `X.offset` (float32, the scale's shape) with offsets;
a bias stays `X.bias`.
Quantised: the linear weights of attention (wq wk wv wo), the MLP (w1 w2 w3) and MoE experts; `output` and
the token embedding `tok_embeddings` [V, D] unless turned off (`quantize_output`, `quantize_embedding`), the
embedding as a weight of V rows over D input columns: a row's scale (int8) or its groups of hidden columns,
dequantised as its rows are gathered. Norms and the MoE router stay float.

One scheme covers the model; `tensors` names the weights stored otherwise (a GGUF file mixes types: SmolLM2's Q4_1
linears beside a Q8_0 embedding, a Q6_K lm head dequantised to float beside Q4_0 linears): weight base name ->
null (float) or its own `{"method", "group_size", "offset"}`. :meth:`QuantScheme.for_tensor` gives the scheme of
one weight (a "leaf" scheme: no `tensors`), which is what a layer's kernels see.

Format history: `quantize_embedding` came later; a `quantization` without it (or without `quantize_output`) is a
model whose embedding (output) is float, and reads as it did. `offset` and `tensors` came with GGUF input; a
scheme without them writes neither, so earlier files read and compare as they did.
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


LEAF_KEYS = ("method", "group_size", "offset")


@dataclass(frozen=True)
class QuantScheme:
    method: str                     # "int8" or "int4"
    group_size: int = 0             # columns per scale: int4 always; int8 0 = one scale per output channel
    quantize_output: bool = True    # the lm head `output.weight` too
    quantize_embedding: bool = True  # the token embedding `tok_embeddings.weight` too
    offset: bool = False            # int4: an offset per group too, W ~ nibble * scale + offset (GGUF's Q4_1)
    tensors: Optional[dict] = None  # weight base name -> None (float) or a leaf scheme's dict, where not the above

    def __post_init__(self):
        if self.method not in METHODS:
            raise PmxError(f"quantization method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 0:
            raise PmxError(f"group_size must be a non-negative integer, got {self.group_size!r}")
        if self.method == "int4" and (self.group_size < 2 or self.group_size % 2):
            raise PmxError(f"int4 group_size must be a positive even integer, got {self.group_size!r}")
        if self.offset and self.method != "int4":
            raise PmxError(f"offsets are an int4 scheme's (GGUF's Q4_1), not {self.method}'s")
        for base, leaf in (self.tensors or {}).items():
            if not isinstance(base, str) or not _quantizable_base(base):
                raise PmxError(f"quantization tensors: {base!r} is not a weight that can be quantised")
            if leaf is not None and (not isinstance(leaf, dict) or set(leaf) - set(LEAF_KEYS) or "method" not in leaf):
                raise PmxError(f"quantization tensors: {base!r} must be null or an object with 'method' and "
                               f"optionally 'group_size', 'offset'; got {leaf!r}")
            if leaf is not None:
                QuantScheme(**leaf)

    @classmethod
    def from_dict(cls, d: dict, source: str = "pmx_params quantization") -> "QuantScheme":
        """The scheme a pmx_params.json records; a flag it does not record is off (written before it existed)."""
        known = {"method", "group_size", "quantize_output", "quantize_embedding", "offset", "tensors"}
        if not isinstance(d, dict) or set(d) - known or "method" not in d:
            raise PmxError(f"{source}: expected an object with 'method' and optionally 'group_size', "
                           f"'quantize_output', 'quantize_embedding', 'offset', 'tensors'; got {d!r}")
        return cls(**{"quantize_output": False, "quantize_embedding": False, **d})

    def to_dict(self) -> dict:
        """As pmx_params.json records it: `offset` and `tensors` only where set (so files without them read and
        compare as before)."""
        d = asdict(self)
        if not self.offset:
            del d["offset"]
        if self.tensors is None:
            del d["tensors"]
        return d

    def leaf_dict(self) -> dict:
        """This scheme as one weight's (a `tensors` entry)."""
        return {"method": self.method, "group_size": self.group_size, **({"offset": True} if self.offset else {})}

    def for_tensor(self, name: str) -> Optional["QuantScheme"]:
        """The leaf scheme float weight `name` (a `.weight`) is stored with, None where it stays float."""
        base, _, leaf = name.rpartition(".")
        if leaf != "weight":
            return None
        if self.tensors is not None and base in self.tensors:
            own = self.tensors[base]
            return None if own is None else QuantScheme(**own)
        default = bool(QUANTIZABLE.fullmatch(base)) or (self.quantize_output and base == "output") \
            or (self.quantize_embedding and base == "tok_embeddings")
        return self.leaf() if default else None

    def leaf(self) -> "QuantScheme":
        """The model's default scheme as one weight's."""
        return QuantScheme(self.method, self.group_size, offset=self.offset)

    def quantizes(self, name: str) -> bool:
        """Whether float tensor `name` (a `.weight`) is stored quantised under this scheme."""
        return self.for_tensor(name) is not None

    @property
    def grouped(self) -> bool:
        """Scales per group of input columns (int4, grouped int8), not per output channel."""
        return self.group_size > 0

    def qshape(self, shape: tuple) -> tuple:
        """Shape of `qweight` for a float weight of `shape` [.., N, K]."""
        return (*shape[:-1], shape[-1] // 2) if self.method == "int4" else tuple(shape)

    def scale_shape(self, shape: tuple) -> tuple:
        """Shape of `scale` (and `offset`) for a float weight of `shape` [.., N, K]."""
        return (*shape[:-1], shape[-1] // self.group_size) if self.grouped else tuple(shape[:-1])

    @property
    def qdtype(self) -> torch.dtype:
        return torch.uint8 if self.method == "int4" else torch.int8

    def describe(self) -> str:
        """e.g. "int4 groups of 32 with offsets", "int8 per channel"."""
        return self.method + (f" groups of {self.group_size}" if self.grouped else " per channel") + \
            (" with offsets" if self.offset else "")

    @classmethod
    def of_tensors(cls, leaves: dict) -> Optional["QuantScheme"]:
        """The scheme that stores each weight base name of `leaves` with its leaf scheme (None: float): the leaf most
        layer linears have as the default, the output and embedding flags where they take it, `tensors` for the
        rest. None where every weight is float."""
        from collections import Counter
        linears = Counter(leaf for base, leaf in leaves.items() if leaf is not None and QUANTIZABLE.fullmatch(base))
        others = Counter(leaf for leaf in leaves.values() if leaf is not None)
        if not others:
            return None
        default = (linears or others).most_common(1)[0][0]
        scheme = cls(default.method, default.group_size, leaves.get("output") == default,
                     leaves.get("tok_embeddings") == default, default.offset)
        tensors = {base: None if leaf is None else leaf.leaf_dict() for base, leaf in leaves.items()
                   if scheme.for_tensor(f"{base}.weight") != leaf}
        return scheme if not tensors else cls(**{**asdict(scheme), "tensors": tensors})


def _quantizable_base(base: str) -> bool:
    return bool(QUANTIZABLE.fullmatch(base)) or base in ("output", "tok_embeddings")


def quantizable(name: str) -> bool:
    """Whether float tensor `name` is a weight a scheme may quantise (a linear's, the lm head, the embedding)."""
    base, _, leaf = name.rpartition(".")
    return leaf == "weight" and _quantizable_base(base)


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

def quantize_int8(w: torch.Tensor, group_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """W [.., N, K] -> (q int8 [.., N, K], scale float32 [.., N], or [.., N, K/group_size] for groups); all-zero rows
    (groups) get scale 0."""
    w = w.float()
    if group_size:
        *lead, n, k = w.shape
        if k % group_size:
            raise PmxError(f"int8 in groups needs the input dim ({k}) to be a multiple of group_size {group_size}")
        q, scale = quantize_int8(w.reshape(*lead, n, k // group_size, group_size))
        return q.reshape(*lead, n, k), scale
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


def quantize_int4_offset(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [.., N, K] -> (packed uint8 [.., N, K/2], scale, offset float32 [.., N, K/group_size]): each group's range
    in 15 steps from its minimum, as GGUF's Q4_1 (scale = (max - min) / 15, offset = min)."""
    *lead, n, k = w.shape
    if k % group_size:
        raise PmxError(f"int4 needs the input dim ({k}) to be a multiple of group_size {group_size}")
    g = w.float().reshape(*lead, n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    q = torch.round((g - lo[..., None]) / torch.where(scale == 0, 1.0, scale)[..., None]).clamp_(0, 15)
    return pack_int4(q.to(torch.uint8).reshape(*lead, n, k)), scale, lo


def pack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [.., K] -> bytes [.., K/2]: column 2j low nibble, 2j+1 high nibble."""
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 [.., K/2] -> nibbles 0..15 as uint8 [.., K]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, method: str, dtype: torch.dtype = torch.float32,
               offset: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float weight [.., N, K] that (qweight, scale[, offset]) stands for; computed in float32, then cast. The
    scale's shape says the grouping: [.., N] one per output channel (int8), [.., N, K/G] one per group."""
    if method == "int8":
        q = qweight.float()
    else:
        q = unpack_int4(qweight).float() if offset is not None else unpack_int4(qweight).float() - 8
    if scale.dim() < q.dim():                                                     # int8 per output channel
        return (q * scale.float()[..., None]).to(dtype)
    groups = scale.shape[-1]
    w = q.unflatten(-1, (groups, -1)) * scale.float()[..., None]                   # (.., N, G, group)
    if offset is not None:
        w = w + offset.float()[..., None]
    return w.flatten(-2).to(dtype)


def quant_parts(leaf: QuantScheme) -> tuple:
    """The tensors a weight quantised with leaf scheme `leaf` is stored as: X.qweight, X.scale[, X.offset]."""
    return ("qweight", "scale", "offset") if leaf.offset else ("qweight", "scale")


def quantize(w: torch.Tensor, scheme: QuantScheme) -> tuple:
    """W quantised with leaf scheme `scheme`: its :func:`quant_parts`, in that order."""
    if scheme.method == "int8":
        return quantize_int8(w, scheme.group_size)
    return quantize_int4_offset(w, scheme.group_size) if scheme.offset else quantize_int4(w, scheme.group_size)


# -- layout of a quantised model -----------------------------------------------------------------

def quantized_tensors(scheme: QuantScheme, tensors: dict) -> dict:
    """{name: unsplit shape} of a float model -> the same with each quantised weight replaced, in place in
    the order, by its :func:`quant_parts` (`qweight`, `scale`[, `offset`])."""
    out, grouped = {}, {}
    leaves = {name: scheme.for_tensor(name) for name in tensors}
    for name, leaf in leaves.items():
        if leaf is not None and leaf.grouped:
            grouped.setdefault((leaf.method, leaf.group_size), {})[name] = tensors[name]
    for (method, group_size), weights in grouped.items():
        _check_group_size(method, group_size, weights)
    for name, shape in tensors.items():
        leaf = leaves[name]
        if leaf is None:
            out[name] = shape
            continue
        base = name[: -len(".weight")]
        for part in quant_parts(leaf):
            out[f"{base}.{part}"] = leaf.qshape(shape) if part == "qweight" else leaf.scale_shape(shape)
    return out


def _check_group_size(method: str, group_size: int, weights: dict) -> None:
    """Every quantised weight's input dim must hold whole groups; the error lists every group size that would
    do (the even divisors of the input dims' greatest common divisor), so none is found one failure at a time."""
    bad = next((n for n, shape in weights.items() if shape[-1] % group_size), None)
    if bad is None:
        return
    common = math.gcd(*(shape[-1] for shape in weights.values()))
    fits = [g for g in range(2, common + 1, 2) if common % g == 0]
    hint = (f"group sizes that divide every input dim: {', '.join(map(str, fits))}" if fits else
            f"no {method} group size divides every input dim (their common divisor is {common}); use --quantize int8")
    raise PmxError(f"{method} with group_size {group_size}: tensor {bad!r} has input dim {weights[bad][-1]}, not a "
                   f"multiple of it; {hint}")


def tensor_dtype(params, name: str, float_dtype: torch.dtype) -> torch.dtype:
    """Stored dtype of tensor `name` of a model with params `params` (float tensors: `float_dtype`)."""
    scheme = scheme_of(params)
    base, _, part = name.rpartition(".")
    leaf = scheme.for_tensor(f"{base}.weight") if scheme is not None and part in QUANT_PARTS else None
    if leaf is None:
        return float_dtype
    return leaf.qdtype if part == "qweight" else torch.float32


QUANT_PARTS = ("qweight", "scale", "offset")


def is_quant_tensor(name: str) -> bool:
    return name.rpartition(".")[2] in QUANT_PARTS


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
    fetch: each quantised `X.weight` becomes its :func:`quant_parts`, computed from one read of the weight (the
    scale and offset are held until they are asked for, next)."""
    out, pending = [], {}
    for name, dtype, shape in plan:
        leaf = scheme.for_tensor(name)
        if leaf is None:
            out.append((name, dtype, shape))
            continue
        base = name[: -len(".weight")]
        out += [(f"{base}.{part}", leaf.qdtype if part == "qweight" else torch.float32,
                 leaf.qshape(shape) if part == "qweight" else leaf.scale_shape(shape)) for part in quant_parts(leaf)]
    quantized_tensors(scheme, {n: s for n, _, s in plan})  # refuses shapes the scheme cannot take, up front

    def fetch_q(name: str) -> torch.Tensor:
        base, _, part = name.rpartition(".")
        if part == "qweight":
            leaf = scheme.for_tensor(f"{base}.weight")
            q, *rest = quantize(as_tensor(fetch(f"{base}.weight")), leaf)
            pending.update({f"{base}.{p}": t for p, t in zip(quant_parts(leaf)[1:], rest)})
            return q
        if name in pending:
            return pending.pop(name)
        return fetch(name)
    return out, fetch_q
