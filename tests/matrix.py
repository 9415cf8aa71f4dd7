"""A parameter matrix whose default run covers every pair of values (all-pairs), the rest of the product marked
`extended` (run with --extended: tests/conftest.py).

Each axis is a list of values; a value that is a tuple stands for several of the test's parameters (it is spread into
them). The cover is greedy and deterministic: the product's combinations in order, each next pick the one that covers
the most pairs of values no pick covers yet, until every pair of values of two axes appears in some pick."""

from __future__ import annotations

import itertools

import pytest


def _flat(combo: tuple) -> tuple:
    return tuple(x for v in combo for x in (v if isinstance(v, tuple) else (v,)))


def _pairs(idx: tuple) -> set:
    return {(i, a, j, b) for (i, a), (j, b) in itertools.combinations(enumerate(idx), 2)}


def pairwise(*axes: list, full: bool = False) -> list:
    """pytest params of the product of `axes`: those of an all-pairs cover as they are, the others marked `extended`
    (every one unmarked where `full`, e.g. on a GPU, where the whole matrix takes seconds)."""
    product = list(itertools.product(*(range(len(a)) for a in axes)))
    chosen, uncovered = set(), set().union(*(_pairs(idx) for idx in product))
    while uncovered:
        best = max((idx for idx in product if idx not in chosen), key=lambda idx: len(_pairs(idx) & uncovered))
        chosen.add(best)
        uncovered -= _pairs(best)
    marks = lambda idx: () if full or idx in chosen else (pytest.mark.extended,)  # noqa: E731
    return [pytest.param(*_flat(tuple(a[i] for a, i in zip(axes, idx))), marks=marks(idx)) for idx in product]
