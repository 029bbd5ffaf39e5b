"""The most tokens a regex constraint can ever produce, read from the pattern's syntax tree.

Used to refuse `regex="a", min_new_tokens=5` up front: the grammar would end after one token
while min_new_tokens forbids ending, and the request could only fail on the engine thread.

Every token the constrained sampler can pick decodes to at least one byte, so a language
whose longest string has B UTF-8 bytes ends within B tokens. The bound is computed on the
parse tree (linear in the pattern; no automaton is built, which can be exponential):
concatenation adds, alternation takes the largest, `{m,n}` multiplies by n, `*`/`+`/`{m,}`
are unbounded. A pattern interegular cannot parse, or a node it does not know, gives None
("no bound known") and the check is skipped: it refuses only requests that cannot succeed.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["max_regex_bytes"]

_UNBOUNDED = math.inf


def max_regex_bytes(regex: str) -> float | None:
    """Longest UTF-8 length of a string the regex matches (inf: unbounded; None: unknown)."""
    try:
        from interegular import parse_pattern

        tree = parse_pattern(regex)
        return _bound(tree)
    except Exception:  # unsupported syntax, deep nesting (RecursionError): no bound known
        return None


def _bound(node: Any) -> float:
    kind = type(node).__name__
    if kind == "__DotCls":  # `.`: any character
        return 4
    if kind == "_CharGroup":  # \d, \w, \s are ASCII classes here, as in xgrammar
        if node.negated:
            return 4  # any character but a few: up to 4 bytes in UTF-8
        return max((len(c.encode("utf-8", "surrogatepass")) for c in node.chars), default=0)
    if kind == "_Concatenation":
        return sum(_bound(part) for part in node.parts)
    if kind == "Pattern":
        return max((_bound(option) for option in node.options), default=0)
    if kind == "_Repeated":
        if node.max is None:
            base = _bound(node.base)
            return 0 if base == 0 else _UNBOUNDED
        return node.max * _bound(node.base)
    if kind == "_NonCapturing":  # lookarounds and anchors consume nothing
        return 0
    raise TypeError(f"unknown regex node {kind}")
