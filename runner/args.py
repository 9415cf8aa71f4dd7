"""Parsing of list-valued flags. fire hands over "1,2" as a tuple, "1 2" as a string and 1 as an int;
each gives the same list here."""

from __future__ import annotations

from runner.errors import PmxError


def items(value) -> list:
    """None / "" -> []; "a,b" / "a b" -> ["a", "b"]; a scalar -> [it]; a sequence -> list(it)."""
    if value is None:
        return []
    if isinstance(value, str):
        return value.replace(",", " ").split()
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def int_list(value, flag: str, minimum: int = 0, allow_empty: bool = True) -> list[int]:
    """The integers of a list flag, each >= minimum; a clear error naming `--flag` otherwise."""
    kind = "positive integers" if minimum == 1 else f"integers >= {minimum}"
    try:
        out = [int(x) for x in items(value)]
    except (TypeError, ValueError):
        out = None
    if out is None or any(x < minimum for x in out) or (not out and not allow_empty):
        raise PmxError(f"--{flag} must be {kind} separated by commas or spaces, got {value!r}")
    return out
