"""Small sequence helpers shared by the language, the remote backends and the engine."""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["common_prefix_len"]


def common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix of two sequences.

    Compares slices (C-speed) and binary-searches the first difference, so comparing two
    2k-token prompts costs a handful of slice compares instead of a Python loop per token.
    """
    a, b = list(a), list(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n
    while lo < hi:  # invariant: a[:lo] == b[:lo] and a[:hi + 1] != b[:hi + 1]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
