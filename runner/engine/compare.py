"""Precision comparison of two dump trees (like MacaPrecision): `python -m runner compare A B [--per_layer]`.

A tree is a dump root with `rank_{r}/` folders (Demo.py --dump_tensor_path, replay's output_dir) or
one such folder. For every (rank, step, tensor) present in both: shapes, max |diff|, cosine, SNR,
MSE and a verdict. Float tensors pass by the chosen metric's threshold with A as the reference;
integer tensors (token ids, starts) must be equal; a pair whose shapes or kinds differ (e.g. an int8
cache against a float one) is reported and skipped. The exit status is 1 when a pair fails or nothing
could be compared.

Trees of different rank counts (TP=1 against TP=N) are compared whole: each tree's shards are gathered first
(the KV cache and scales along their head dim, a layer's q / k / v / attention along heads, KV heads stored on
several ranks taken once), and a tensor every rank holds whole (logits, the step's inputs, a layer's norm, o,
ffn, residual) is taken from rank 0 after checking the other ranks hold the same. With --per_layer (dumps of
Demo.py --dump_layers, or of onnx_replay --dump_layers) only the layers' values are compared, in the order they
are computed, and the first layer and op under --threshold is named.
"""

from __future__ import annotations

import csv as csv_mod
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional, Sequence

import torch

from runner.args import OneOf, int_list, items
import re

from runner.engine.dump import DUMP_DTYPES, dump_files, load_meta, read_dump_file
from runner.engine.layer_dump import HEAD_OPS, LAYER_OPS
from runner.engine.replay import Agreement
from runner.errors import PmxError
from runner.pmx.store import atomic_file

DEFAULT_THRESHOLDS = {"snr": 40.0, "cosine": 0.999, "mse": 1e-4}


@dataclass
class Row:
    rank: str
    step: int
    name: str
    shape_a: tuple
    shape_b: tuple
    agreement: Optional[Agreement]
    verdict: str  # pass, FAIL, skip (...)


def _rank_dirs(root: Path) -> dict[str, Path]:
    if not root.is_dir():
        raise PmxError(f"{root}: dump directory not found")
    ranks = {p.name: p for p in sorted(root.iterdir()) if p.is_dir() and p.name.startswith("rank_")}
    return ranks or {".": root}


def _passes(a: Agreement, metric: str, threshold: float) -> bool:
    if metric == "snr":
        return a.snr_db >= threshold
    if metric == "cosine":
        return a.cosine >= threshold
    return a.mse <= threshold


def compare_trees(dir_a: str, dir_b: str, metric: str = "snr", threshold: Optional[float] = None,
                  tensors: Optional[Sequence[str]] = None, steps: Optional[Sequence[int]] = None) -> list[Row]:
    if metric not in DEFAULT_THRESHOLDS:
        raise PmxError(f"--metric must be one of {', '.join(DEFAULT_THRESHOLDS)}, got {metric!r}")
    thr = DEFAULT_THRESHOLDS[metric] if threshold is None else float(threshold)
    ra, rb = _rank_dirs(Path(dir_a)), _rank_dirs(Path(dir_b))
    if len(ra) != len(rb):
        return _compare_gathered(ra, rb, metric, thr, tensors, steps)
    if ("." in ra) != ("." in rb):  # one rank's folder against a tree: compare it with the tree's rank_0
        ra, rb = ({".": d.get(".", d.get("rank_0"))} for d in (ra, rb))
        if None in (ra["."], rb["."]):
            raise PmxError(f"{dir_a if ra['.'] is None else dir_b}: has no rank_0 to compare with a single folder")
    rows = []
    for rank in sorted(set(ra) & set(rb), key=lambda r: (len(r), r)):
        fa, fb = dump_files(ra[rank]), dump_files(rb[rank])
        for key in sorted(set(fa) & set(fb)):
            step, name = key
            if (tensors and name not in tensors) or (steps and step not in steps):
                continue
            ta, tb = read_dump_file(fa[key]), read_dump_file(fb[key])
            rows.append(_compare_pair(rank, step, name, ta, tb, metric, thr))
    return rows


LAYER_RE = re.compile(r"layer(\d+)_(\w+)")


def _shard_dim(name: str, layout: Optional[int]) -> Optional[int]:
    """The dim along which a tensor is cut across ranks (None: every rank holds it whole)."""
    if name in ("kv_cache", "kv_scale"):
        return None if layout is None else (2 if layout == 3 else 3)   # (.., KV, MaxT, D) in layout 3, else (.., KV, D)
    m = LAYER_RE.fullmatch(name)
    return 1 if m and m.group(2) in HEAD_OPS else None


def _gathered(ranks: dict[str, Path], key: tuple) -> tuple[Optional[torch.Tensor], str]:
    """(the tensor `key` of a tree, its shards gathered; or None) and why it could not be."""
    dirs = [ranks[r] for r in sorted(ranks, key=lambda r: (len(r), r))]
    files = [dump_files(d).get(key) for d in dirs]
    if any(f is None for f in files):
        return None, "skip (not on every rank)"
    parts = [read_dump_file(f) for f in files]
    meta = load_meta(str(dirs[0])) or {}
    name = key[1]
    dim = _shard_dim(name, meta.get("options", {}).get("cache_layout"))
    if dim is None:
        if name in ("kv_cache", "kv_scale"):
            return None, "skip (no engine.json: cache layout unknown)"
        if any(p.shape != parts[0].shape or not torch.equal(p, parts[0]) for p in parts[1:]):
            return None, "FAIL (its ranks differ)"
        return parts[0], ""
    m = LAYER_RE.fullmatch(name)
    if name in ("kv_cache", "kv_scale") or (m and HEAD_OPS[m.group(2)] == "kv_heads"):
        parts = parts[::max(int(meta.get("kv_replication", 1)), 1)]   # a KV head stored on several ranks, once
    return torch.cat(parts, dim=dim), ""


def _compare_gathered(ra, rb, metric, thr, tensors, steps) -> list[Row]:
    ka, kb = (set(dump_files(next(iter(r.values()))).keys()) for r in (ra, rb))
    rows = []
    for key in sorted(ka & kb):
        step, name = key
        if (tensors and name not in tensors) or (steps and step not in steps):
            continue
        (ta, why_a), (tb, why_b) = _gathered(ra, key), _gathered(rb, key)
        if ta is None or tb is None:
            rows.append(Row("all", step, name, (), (), None, why_a or why_b))
            continue
        rows.append(_compare_pair("all", step, name, ta, tb, metric, thr))
    return rows


def _layer_order(row: Row) -> tuple:
    m = LAYER_RE.fullmatch(row.name)
    return (row.step, int(m.group(1)), LAYER_OPS.index(m.group(2)) if m.group(2) in LAYER_OPS else 99, row.rank)


def _compare_pair(rank, step, name, ta, tb, metric, thr) -> Row:
    row = Row(rank, step, name, tuple(ta.shape), tuple(tb.shape), None, "")
    if ta.shape != tb.shape:
        row.verdict = "skip (shapes differ)"
        return row
    fa, fb = ta.dtype.is_floating_point, tb.dtype.is_floating_point
    if fa != fb or (ta.dtype == torch.int8) != (tb.dtype == torch.int8):
        row.verdict = f"skip ({DUMP_DTYPES[ta.dtype]} vs {DUMP_DTYPES[tb.dtype]})"
        return row
    row.agreement = Agreement.of(tb, ta)
    if not fa:
        row.verdict = "pass" if torch.equal(ta, tb) else "FAIL"
    else:
        row.verdict = "pass" if _passes(row.agreement, metric, thr) else "FAIL"
    return row


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.4g}"


def compare(dir_a: str, dir_b: str, metric: Annotated[str, OneOf("snr", "cosine", "mse")] = "snr",
            threshold: Optional[float] = None, csv: Optional[str] = None, tensors: Optional[str] = None,
            steps: Optional[str] = None, per_layer: bool = False) -> int:
    """Compare two dump trees tensor by tensor (A is the reference); exit status 1 when one fails.

    Args:
        dir_a: a dump root (with rank_r folders) or one rank's folder, e.g. a TP=1 run's dump.
        dir_b: the same for the other run, e.g. a TP=2 run's dump, or replay's output_dir.
        metric: snr (dB, higher is better), cosine or mse (lower is better) decides the verdict.
        threshold: pass mark for the metric (default: snr 40, cosine 0.999, mse 1e-4).
        csv: also write the table to this CSV file.
        tensors: only these tensors, comma-separated (e.g. logits).
        steps: only these steps, comma-separated.
        per_layer: compare each layer's values (dumps with --dump_layers) in the order they are computed, and name
            the first layer and op under the threshold.

    Trees of different rank counts are compared after gathering each one's shards (row rank "all").
    """
    out = sys.stdout
    tensors, steps = [str(t) for t in items(tensors)], int_list(steps, "steps")
    rows = compare_trees(dir_a, dir_b, metric, threshold, tensors, steps)
    if per_layer:
        rows = sorted((r for r in rows if LAYER_RE.fullmatch(r.name)), key=_layer_order)
        if not rows:
            raise PmxError(f"{dir_a} and {dir_b} have no layer values in common (dump with Demo.py --dump_layers)")
    if not rows:
        raise PmxError(f"{dir_a} and {dir_b} have no step tensor in common"
                       + (f" among {list(tensors)}" if tensors else ""))
    thr = DEFAULT_THRESHOLDS[metric] if threshold is None else threshold
    header = ["rank", "step", "tensor", "shape", "max_abs_diff", "cosine", "snr_db", "mse", "verdict"]
    table = []
    for r in rows:
        a = r.agreement
        shape = "x".join(map(str, r.shape_a)) + ("" if r.shape_a == r.shape_b else " / " + "x".join(map(str, r.shape_b)))
        table.append([r.rank, str(r.step), r.name, shape] +
                     ([_fmt(a.max_abs), f"{a.cosine:.6f}", _fmt(a.snr_db), _fmt(a.mse)] if a else ["-"] * 4) + [r.verdict])
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(header)]
    for t in [header] + table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip(), file=out)
    failed = sum(r.verdict.startswith("FAIL") for r in rows)
    skipped = sum(r.verdict.startswith("skip") for r in rows)
    print(f"{len(rows) - skipped} compared ({metric} {'<=' if metric == 'mse' else '>='} {thr}), {failed} failed, "
          f"{skipped} skipped", file=out)
    ranks = {len(_rank_dirs(Path(d))) for d in (dir_a, dir_b)}
    if len(ranks) > 1:
        print(f"{dir_a} and {dir_b} hold different rank counts: each tree's shards were gathered (rank 'all')",
              file=out)
    if per_layer:
        first = next((r for r in rows if r.verdict.startswith("FAIL")), None)
        print(f"first under the threshold: step {first.step}, layer {LAYER_RE.fullmatch(first.name).group(1)}, op "
              f"{LAYER_RE.fullmatch(first.name).group(2)} ({first.name}, rank {first.rank})" if first else
              "every layer and op passes", file=out)
    if csv:
        with atomic_file(Path(csv), "the CSV") as tmp, open(tmp, "w", newline="") as f:
            w = csv_mod.writer(f)
            w.writerow(header)
            w.writerows(table)
    if failed or skipped == len(rows):
        return 1
    return 0
