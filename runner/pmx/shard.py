"""The shard-spec table: how each PMX tensor is cut across tensor-parallel ranks.

One table serves both split and merge (Megatron-style cut, as ppl.pmx):

| tensor                                   | cut                                           |
|------------------------------------------|-----------------------------------------------|
| attention.wq.{weight,bias}               | query heads, by output rows                   |
| attention.wk/wv.{weight,bias}            | KV heads by rows; replicated when KV < ranks  |
| attention.wo.weight                      | query heads, by input columns                 |
| feed_forward.w1/w3.{weight,bias}         | intermediate rows (zero-padded to divide)     |
| feed_forward.w2.weight                   | intermediate columns (zero-padded)            |
| output.weight                            | vocabulary rows (zero-padded)                 |
| tok_embeddings.weight                    | hidden columns (zero-padded)                  |
| norms (post norms too), router `gate`, wo/w2 biases, q/k norms | replicated              |

Axes count from the end, so MoE experts stacked as [E, out, in] are cut like a dense MLP.

A weight-only quantised weight (runner/pmx/quant.py) is cut like its float weight: `qweight` on the
same axis (in bytes, two int4 columns each, along the input dim), `scale` (and `offset`) with its rows. A
per-channel int8 scale is one per output row, so it is cut with the rows of a column-parallel weight and replicated
beside a row-parallel one (wo, w2) or the embedding (cut by hidden columns), whose scales cover the full row. Groups
(int4, grouped int8) run along the input dim: a row-parallel (or embedding) cut must fall on group boundaries, and
a split that would cut a group is refused.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

import torch

from runner.errors import PmxError
from runner.pmx.params import PmxParams
from runner.pmx.quant import QUANT_PARTS, scheme_of
from runner.pmx.schema import pmx_tensors
from runner.pmx.stored import Stored


@dataclass(frozen=True)
class Cut:
    kind: str                 # "replicate" | "q_heads" | "kv_heads" | "dim"
    axis: int = 0             # negative: from the end
    dim: Optional[str] = None  # logical dim for kind "dim" (its padding is recorded in padded_dims)
    unit: int = 1             # logical columns per stored element along `axis` (int4 qweight: 2, int4 scale: G)


REPLICATE = Cut("replicate")
SHARD_SPEC: tuple[tuple[str, Cut], ...] = (
    (r"tok_embeddings\.weight", Cut("dim", -1, "hidden_dim")),
    (r"output\.weight", Cut("dim", -2, "vocab_size")),
    (r"norm\.weight", REPLICATE),
    (r"layers\.\d+\.(attention_norm|ffn_norm|post_attention_norm|post_ffn_norm)\.weight", REPLICATE),
    (r"layers\.\d+\.attention\.wq\.weight", Cut("q_heads", -2)),
    (r"layers\.\d+\.attention\.wq\.bias", Cut("q_heads", -1)),
    (r"layers\.\d+\.attention\.(wk|wv)\.weight", Cut("kv_heads", -2)),
    (r"layers\.\d+\.attention\.(wk|wv)\.bias", Cut("kv_heads", -1)),
    (r"layers\.\d+\.attention\.(q_norm|k_norm)\.weight", REPLICATE),
    (r"layers\.\d+\.attention\.wo\.weight", Cut("q_heads", -1)),
    (r"layers\.\d+\.attention\.wo\.bias", REPLICATE),
    (r"layers\.\d+\.feed_forward\.(w1|w3)\.weight", Cut("dim", -2, "intermediate_dim")),
    (r"layers\.\d+\.feed_forward\.(w1|w3)\.bias", Cut("dim", -1, "intermediate_dim")),
    (r"layers\.\d+\.feed_forward\.w2\.weight", Cut("dim", -1, "intermediate_dim")),
    (r"layers\.\d+\.feed_forward\.w2\.bias", REPLICATE),
    (r"layers\.\d+\.feed_forward\.gate\.weight", REPLICATE),
)


def cut_for(name: str) -> Cut:
    for pattern, cut in SHARD_SPEC:
        if re.fullmatch(pattern, name):
            return cut
    raise PmxError(f"tensor {name!r} has no shard rule; expected one of the PMX tensor names (see runner/pmx/shard.py)")


def _cut(p: PmxParams, name: str) -> Cut:
    """`cut_for(name)`, extended to the `qweight` / `scale` / `offset` of a quantised model with params `p`."""
    base, _, part = name.rpartition(".")
    scheme = scheme_of(p)
    leaf = scheme.for_tensor(f"{base}.weight") if scheme is not None and part in QUANT_PARTS else None
    if leaf is None:
        return cut_for(name)
    w = cut_for(f"{base}.weight")
    if w.kind == "replicate" or w.axis != -1:  # cut by output rows (or not at all): scales go with the rows
        return Cut(w.kind, -1, w.dim) if part != "qweight" and not leaf.grouped and w.axis == -2 else w
    if not leaf.grouped:  # cut by input columns: the per-row scale covers the full row
        return w if part == "qweight" else REPLICATE
    unit = (2 if leaf.method == "int4" else 1) if part == "qweight" else leaf.group_size
    return Cut(w.kind, w.axis, w.dim, unit=unit)


def _check_groups(p: PmxParams, sharded: PmxParams) -> None:
    """Weights quantised in groups: every input dim must hold whole groups, and so must every cut by input columns
    (row-parallel weights and the embedding: columns per rank); a group is never split."""
    scheme, n = scheme_of(p), sharded.num_shards
    if scheme is None:
        return
    pmx_tensors(p)  # refuses an input dim that is not a multiple of group_size, naming the tensor
    floats = pmx_tensors(p.replace(quantization=None))
    seen = set()
    for name in floats:
        leaf = scheme.for_tensor(name)
        cut = cut_for(name)
        if leaf is None or not leaf.grouped or cut.kind == "replicate" or cut.axis != -1:
            continue
        cols = p.num_heads * p.head_dim // n if cut.kind == "q_heads" else sharded.padded(cut.dim) // n
        tensor = re.sub(r"^layers\.\d+\.", "layers.*.", name[: -len(".weight")])
        if cols % leaf.group_size and (tensor, leaf) not in seen:
            seen.add((tensor, leaf))
            raise PmxError(f"num_shards={n} cannot be honoured: it would cut the {leaf.method} groups of tensor "
                           f"{tensor!r} ({cols} input columns per rank, group_size {leaf.group_size}); quantise with "
                           f"a --group_size that divides {cols}, or pick another shard count")


def sharded_params(p: PmxParams, num_shards: int) -> PmxParams:
    """Params of `p` (unsplit) cut into `num_shards`, or a clear error if the model cannot be cut so."""
    n = num_shards
    if not isinstance(n, int) or n < 1:
        raise PmxError(f"num_shards must be a positive integer, got {n!r}")
    if p.num_heads % n:
        raise PmxError(f"num_shards={n} cannot be honoured: num_heads={p.num_heads} is not divisible by {n}")
    kv = p.num_kv_heads
    if kv % n and n % kv:
        raise PmxError(f"num_shards={n} cannot be honoured: num_kv_heads={kv} must divide it or be divisible by it")
    padded = {d: math.ceil(getattr(p, d) / n) * n for d in ("hidden_dim", "intermediate_dim", "vocab_size")
              if getattr(p, d) % n}
    sharded = p.replace(num_shards=n, kv_replication=max(1, n // kv), padded_dims=padded)
    _check_groups(p, sharded)
    return sharded


def unsharded_params(p: PmxParams) -> PmxParams:
    return p.replace(num_shards=1, kv_replication=1, padded_dims={})


def _cut_size(p: PmxParams, name: str, size: int, part: bool) -> int:
    """The cut axis's length of `name`: one rank's part (`part`) of a full `size`, or the full length of a part."""
    cut, n = _cut(p, name), p.num_shards
    if cut.kind == "dim":
        return (p.padded(cut.dim) // n if part else getattr(p, cut.dim)) // cut.unit
    if cut.kind == "q_heads":
        return size // n if part else size * n
    return (max(p.num_kv_heads // n, 1) if part else p.num_kv_heads) * p.head_dim // cut.unit  # kv_heads


def _reshape(p: PmxParams, name: str, shape: tuple, part: bool) -> tuple:
    cut = _cut(p, name)
    if cut.kind == "replicate" or p.num_shards == 1:
        return tuple(shape)
    shape = list(shape)
    shape[cut.axis] = _cut_size(p, name, shape[cut.axis], part)
    return tuple(shape)


def shard_shape(p: PmxParams, name: str, shape: tuple) -> tuple:
    """Shape of one rank's part of tensor `name` (full `shape`) under sharded params `p`."""
    return _reshape(p, name, shape, part=True)


def full_shape(p: PmxParams, name: str, part: tuple) -> tuple:
    """Unsplit shape of `name` given one rank's part shape (inverse of :func:`shard_shape`)."""
    return _reshape(p, name, part, part=False)


def _windows(p: PmxParams, name: str, shape: tuple) -> tuple[int, list[tuple[int, int]]]:
    """The axis `name` is cut along and each rank's (start, length) on it, in the full tensor of `shape`; a window
    past the end of the axis is zero padding."""
    cut, n = _cut(p, name), p.num_shards
    ax = cut.axis % len(shape)
    if cut.kind == "dim":
        per = p.padded(cut.dim) // cut.unit // n
        return ax, [(r * per, per) for r in range(n)]
    if cut.kind == "q_heads" or p.kv_replication == 1:
        per = shape[ax] // n
        return ax, [(r * per, per) for r in range(n)]
    per = shape[ax] // p.num_kv_heads  # kv_heads with replication: rank r holds KV head r // replication
    return ax, [((r // p.kv_replication) * per, per) for r in range(n)]


def split_tensor(p: PmxParams, name: str, t: torch.Tensor | Stored) -> list:
    """Cuts full tensor `t` into `p.num_shards` parts: views of a tensor (a padded one is copied once), or Stored
    parts of a Stored tensor (its file ranges, nothing read)."""
    if _cut(p, name).kind == "replicate" or p.num_shards == 1:
        return [t] * p.num_shards
    ax, windows = _windows(p, name, tuple(t.shape))
    if isinstance(t, Stored):
        return [t.narrow(ax, start, length) for start, length in windows]
    end = max(start + length for start, length in windows)
    if end > t.shape[ax]:
        pad_shape = list(t.shape)
        pad_shape[ax] = end - t.shape[ax]
        t = torch.cat([t, t.new_zeros(pad_shape)], dim=ax)
    return [t.narrow(ax, start, length) for start, length in windows]


def merge_tensor(p: PmxParams, name: str, parts: list) -> torch.Tensor | Stored:
    """Puts the `p.num_shards` parts of `name` back together (tensors, or Stored parts: then a Stored tensor, its
    file ranges); replicas must agree bit for bit."""
    cut, n = _cut(p, name), p.num_shards
    if cut.kind == "replicate" or n == 1:
        _check_replicas(name, parts, range(n))
        return parts[0]
    ax = cut.axis % len(parts[0].shape)
    if cut.kind == "kv_heads" and p.kv_replication > 1:
        rep = p.kv_replication
        for k in range(p.num_kv_heads):
            _check_replicas(name, parts, range(k * rep, (k + 1) * rep))
        parts = parts[::rep]
    t = Stored.cat(parts, ax) if isinstance(parts[0], Stored) else torch.cat(parts, dim=ax)
    if cut.kind == "dim" and t.shape[ax] != getattr(p, cut.dim) // cut.unit:
        t = t.narrow(ax, 0, getattr(p, cut.dim) // cut.unit)
    return t


def _same(a, b) -> bool:
    if isinstance(a, Stored):
        return a.same_bytes(b)
    return torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point else a,
                       b.view(torch.uint8) if b.dtype.is_floating_point else b)


def _check_replicas(name: str, parts: list, ranks) -> None:
    ranks = list(ranks)
    ref = parts[ranks[0]]
    for r in ranks[1:]:
        if not _same(ref, parts[r]):
            raise PmxError(f"tensor {name!r}: shard {r} differs from shard {ranks[0]}, but they must hold the same "
                           f"replicated values")
