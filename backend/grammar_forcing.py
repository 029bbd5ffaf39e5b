"""How long can the text a grammar forces get? A bound, computed once per compiled grammar.

Jump-forward asks xgrammar for the forced continuation (`find_jump_forward_string`). That call
walks the grammar one byte at a time until a second byte becomes possible or the grammar could
end, in C++, holding the GIL, with no limit. For a grammar that can never end it never returns:

    root ::= "a" root                          forces "aaaa..." forever
    {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                     "required": ["x"]}}, "$ref": "#/$defs/a"}       forces {"x": {"x": ...

and the string it builds grows until the process runs out of memory. A grammar that does end
can still force an enormous text: `r0 ::= r1 r1`, `r1 ::= r2 r2`, ... 30 rules deep, or an
array schema with `"minItems": 1000000` of a `const`. We cannot interrupt the call, so we only
make it where the answer is provably short.

Why a bound exists: the walk stops where the grammar could end, so the forced text is never
longer than the shortest completion from the current state. A parser state is a stack of
partly matched rule alternatives; the shortest completion is at most the sum, over the stack,
of the shortest way to finish each alternative, and each of those is at most

    frame_bound = max over reachable rules r of worst(body(r))

where worst() of an alternative is the sum of the shortest texts of its elements (the
largest such sum over nested choices). So the forced text is at most stack depth *
frame_bound bytes. We compute frame_bound from the grammar's expression tree
(`Grammar.serialize_json`): the shortest text of every rule by Knuth's generalisation of
Dijkstra's algorithm (each rule is finalised once, when it is the cheapest open one; linear in
the grammar), then worst() per rule. A reachable rule with no finite text (never ends) gives None, as does any
expression type we do not model (token-level tags, unknown future types): "no bound known".
The engine decodes such grammars without jump-forward (`CompiledConstraint.forced_bound`).

Lookahead assertions only ever remove continuations, never add forced bytes past a point
where the grammar could end, so they are ignored. A regex inside a grammar (JSON Schema
`pattern`) is bounded crudely: its length times every repetition count in it.
"""

from __future__ import annotations

import heapq
import json
import re
from typing import Any

__all__ = ["MAX_FRAME_BOUND", "forced_text_bound"]

# Above this many bytes per stack frame, xgrammar's forced-text walk is not worth its cost per
# decode step (a few ms for 64 KiB), so such grammars decode without jump-forward.
MAX_FRAME_BOUND = 64 * 1024

# xgrammar's expression types (grammar_impl.h, GrammarExprType), serialization "v18".
_BYTES, _CLASS, _CLASS_STAR, _EMPTY, _RULE_REF, _SEQUENCE, _CHOICES = 0, 1, 2, 3, 4, 5, 6
_REPEAT, _REGEX = 8, 12
_KNOWN_VERSIONS = frozenset({"v18"})
_INF = float("inf")
_REPEAT_COUNT = re.compile(rb"\{(\d+)")


class _Unmodelled(Exception):
    """The grammar uses an expression type this module does not reason about."""


class _Exprs:
    """The grammar's expressions, decoded from xgrammar's CSR layout: (type, payload)."""

    def __init__(self, doc: dict[str, Any]) -> None:
        data: list[int] = doc["grammar_expr_data"]
        indptr: list[int] = doc["grammar_expr_indptr"]
        # Each expression is [type, payload_len, payload...] starting at indptr[i].
        self.items: list[tuple[int, list[int]]] = [
            (data[start], data[start + 2 : start + 2 + data[start + 1]]) for start in indptr
        ]
        self.rule_bodies: list[int] = [int(rule[1]) for rule in doc["rules"]]

    def rule_refs(self, expr_id: int) -> set[int]:
        """Rules an expression can enter (directly or through nested expressions)."""
        found: set[int] = set()
        stack = [expr_id]
        while stack:
            kind, payload = self.items[stack.pop()]
            if kind in (_RULE_REF, _REPEAT):
                found.add(payload[0])
            elif kind in (_SEQUENCE, _CHOICES):
                stack.extend(payload)
            elif kind not in (_BYTES, _CLASS, _CLASS_STAR, _EMPTY, _REGEX):
                raise _Unmodelled(f"expression type {kind}")
        return found


def forced_text_bound(grammar: Any, limit: int = MAX_FRAME_BOUND) -> int | None:
    """Bytes a stack frame of `grammar` (an xgrammar Grammar) can force, or None if unbounded,
    above `limit`, or not known."""
    doc = json.loads(grammar.serialize_json())
    if doc.get("__VERSION__") not in _KNOWN_VERSIONS:
        return None
    try:
        exprs = _Exprs(doc)
        refs = [exprs.rule_refs(body) for body in exprs.rule_bodies]
        reachable = _reachable(int(doc["root_rule_id"]), refs)
        shortest = _shortest_texts(exprs, refs)
        if any(shortest[r] == _INF for r in reachable):
            return None  # a rule the output can enter never ends
        bound = max((_worst(exprs, exprs.rule_bodies[r], shortest) for r in reachable), default=0)
    except (_Unmodelled, LookupError, TypeError, ValueError):  # a layout we do not know
        return None
    return int(bound) if bound <= limit else None


def _reachable(root: int, refs: list[set[int]]) -> set[int]:
    seen = {root}
    stack = [root]
    while stack:
        for nxt in refs[stack.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def _shortest_texts(exprs: _Exprs, refs: list[set[int]]) -> list[float]:
    """Shortest text (bytes) each rule derives; inf where none is finite.

    Knuth's algorithm over the rules' alternatives: an alternative's length is known once
    every rule it mentions is final; the cheapest known candidate is then final for its rule,
    because an alternative is never shorter than a rule it needs. Each alternative is
    evaluated once, so this is linear in the grammar (up to the heap). An alternative with a
    nested choice waits for all rules in it, which can only make a result inf (no bound).
    """
    alternatives: list[tuple[int, int]] = []  # (rule, expression id)
    for rule, body in enumerate(exprs.rule_bodies):
        kind, payload = exprs.items[body]
        for expr in payload if kind == _CHOICES else [body]:
            alternatives.append((rule, expr))
    pending: list[int] = []
    waiting_on: list[list[int]] = [[] for _ in refs]  # rule -> alternatives that mention it
    heap: list[tuple[float, int]] = []
    final: list[float] = [_INF] * len(refs)
    for index, (rule, expr) in enumerate(alternatives):
        needs = exprs.rule_refs(expr)
        pending.append(len(needs))
        for dep in needs:
            waiting_on[dep].append(index)
        if not needs:
            heapq.heappush(heap, (_shortest(exprs, expr, final), rule))
    done = [False] * len(refs)
    while heap:
        value, rule = heapq.heappop(heap)
        if done[rule] or value == _INF:
            continue
        done[rule] = True
        final[rule] = value
        for index in waiting_on[rule]:
            pending[index] -= 1
            if pending[index] == 0:
                owner, expr = alternatives[index]
                if not done[owner]:
                    heapq.heappush(heap, (_shortest(exprs, expr, final), owner))
    return final


def _shortest(exprs: _Exprs, expr_id: int, rules: list[float]) -> float:
    kind, payload = exprs.items[expr_id]
    if kind == _BYTES:
        return len(payload)
    if kind == _CLASS:
        return 1
    if kind in (_CLASS_STAR, _EMPTY):
        return 0
    if kind == _RULE_REF:
        return rules[payload[0]]
    if kind == _REPEAT:
        count = payload[1]
        return 0 if count == 0 else count * rules[payload[0]]
    if kind == _SEQUENCE:
        return sum(_shortest(exprs, e, rules) for e in payload)
    if kind == _CHOICES:
        return min((_shortest(exprs, e, rules) for e in payload), default=_INF)
    if kind == _REGEX:
        return _regex_bound(payload)
    raise _Unmodelled(f"expression type {kind}")


def _worst(exprs: _Exprs, expr_id: int, rules: list[float]) -> float:
    """The longest shortest-completion of any alternative inside an expression."""
    kind, payload = exprs.items[expr_id]
    if kind == _SEQUENCE:
        return sum(_worst(exprs, e, rules) for e in payload)
    if kind == _CHOICES:
        return max((_worst(exprs, e, rules) for e in payload), default=0)
    return _shortest(exprs, expr_id, rules)


def _regex_bound(payload: list[int]) -> float:
    """Crude upper bound on any shortest completion inside a regex: its length in bytes (every
    atom needs at most four bytes per pattern byte) times every counted repetition in it (nested counts
    multiply). payload = [json_string_flag, pattern bytes...]."""
    pattern = bytes(payload[1:])
    bound = 4.0 * max(len(pattern), 1)  # "." is one pattern byte but may match four
    for count in _REPEAT_COUNT.findall(pattern):
        bound *= max(int(count), 1)
    return bound
