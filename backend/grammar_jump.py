"""Jump-forward decoding that keeps the tokenizer's own token boundaries.

When the grammar admits exactly one continuation string S (xgrammar's
`find_jump_forward_string`), the engine can append S's tokens in one extend step instead of
decoding them one per step. Done naively this degrades output (SGLang dropped its version for
that reason): S's tokens are not the tokens the tokenizer would give for the text in context,
and the model then conditions on splits it never saw in training. Two boundaries matter:

    output so far          forced S                 what the model writes next
    ... ' "' 'na'  |  'me": "'                 |  'Bob' ...
          left boundary: 'na' + 'me' should be the single token 'name' (re-merge)
                                     right boundary: ' "' might merge with what follows

Left: re-tokenize T + S, where T is the text of the last k (<= 4) output tokens, keep the
longest prefix of those k tokens that the re-tokenization reproduces, roll back the rest and
append the re-tokenized remainder. The first of the k tokens must survive (the "anchor"):
otherwise the merge may reach further left than the window: we retry with a window twice as
wide, then give up (unless the window holds the whole output: there is nothing further left
but the prompt, which is never re-tokenized).

Right: hold back the last re-tokenized token; the model decodes it itself (masked), free to
choose a longer token that merges it with the next, unforced text. The exception is a jump
that ends the grammar (only a stop token may follow): nothing can merge there.

Never across termination: a point where the grammar could stop is never forced (a stop
token is an alternative), so S ends there at the latest; we do not extend it.

Bounded: one plan appends at most `max_jump_tokens` tokens (the engine's
`max_jump_forward_tokens`, 64 by default) and never more than the request's remaining
`max_new_tokens`; S is cut to `max_jump_tokens * _CHARS_PER_TOKEN` characters before it is
re-tokenized, so a long forced text costs one bounded plan per step. S itself is only asked
for when the grammar's forced text is known to be finite and short
(`ConstraintState.jump_forward`, `grammar_forcing.py`): otherwise xgrammar would never return.

The plan is computed on a fork of the matcher, so planning never changes the request's
state; `apply_plan` commits it after the engine has changed the request's tokens.

Cached: the re-tokenization of a boundary depends only on the window's ids and the forced
text, which repeat across the requests of one schema (every request's opening `{` + its first
key, and most keys after common values), so a `BoundaryCache` shared by a backend's states
remembers them: three tokenizer calls (~40 us) become a lookup. The matcher walk is not
cached: it depends on the matcher's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from sgl._seq import common_prefix_len
from sgl.backend.tokenizer import decode_ids, encode_text

if TYPE_CHECKING:
    import xgrammar as xgr

    from sgl.backend.grammar import ConstraintState

__all__ = ["MIN_JUMP_CHARS", "BoundaryCache", "JumpPlan", "apply_plan", "plan_jump_forward"]

# Forced text is cut to this many characters per allowed token before re-tokenizing: enough
# for the longest tokens of common vocabularies (runs of indentation spaces), so the cut
# rarely binds before the token cap does.
_CHARS_PER_TOKEN = 16
# Forced text shorter than this is not jumped (decoding it costs a step or two anyway).
MIN_JUMP_CHARS = 3


# (tail ids, their text, the re-tokenized ids of text + forced, how many tail ids survive)
_Boundary = tuple[tuple[int, ...], str, tuple[int, ...], int]


class BoundaryCache:
    """Re-tokenized boundaries by (window ids, forced text), at most `size` of them (the
    oldest half goes when full), plus the text of each prefix of the ids asked for."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._boundaries: dict[tuple[tuple[int, ...], str], _Boundary | None] = {}
        self._texts: dict[tuple[int, ...], str] = {}
        self.hits = self.misses = 0

    def boundary(self, tokenizer: Any, tail: tuple[int, ...], forced: str) -> _Boundary | None:
        key = (tail, forced)
        try:
            found = self._boundaries[key]
            self.hits += 1
            return found
        except KeyError:
            self.misses += 1
        found = _retokenize_boundary(tokenizer, tail, forced)
        _bounded_put(self._boundaries, key, found, self.size)
        return found

    def text(self, tokenizer: Any, ids: tuple[int, ...]) -> str:
        found = self._texts.get(ids)
        if found is None:
            found = decode_ids(tokenizer, ids)
            _bounded_put(self._texts, ids, found, self.size)
        return found


def _bounded_put(table: dict[Any, Any], key: Any, value: Any, size: int) -> None:
    if len(table) >= size:
        for old in list(table)[: size // 2]:  # (insertion order: the oldest first)
            del table[old]
    table[key] = value


@dataclass(frozen=True)
class JumpPlan:
    """Drop the last `rollback` output tokens, then append `append_ids` in one extend step.

    Invariant: the text of the kept tokens plus `append_ids` starts with the text of the old
    output tokens, so text already streamed to the user stays valid (it only grows).
    `forced_text` is the grammar's forced string; the appended tokens cover a prefix of it
    (all of it unless the boundary token was held back).
    """

    rollback: int
    append_ids: tuple[int, ...]
    forced_text: str
    boundary_kept: int  # output tokens before the rollback point that re-tokenization kept
    base_accepted: int  # state.num_accepted when planned; apply checks it
    matcher: xgr.GrammarMatcher | None = field(default=None, repr=False, compare=False)

    @property
    def net_new_tokens(self) -> int:
        """How many more output tokens the request has after the jump."""
        return len(self.append_ids) - self.rollback


def plan_jump_forward(
    tokenizer: Any,
    state: ConstraintState,
    output_ids: Sequence[int],
    *,
    max_boundary_tokens: int = 4,
    min_chars: int = MIN_JUMP_CHARS,
    max_new_tokens: int | None = None,
    max_jump_tokens: int = 64,
    cache: BoundaryCache | None = None,
) -> JumpPlan | None:
    """Decide a jump for one request, or None when there is nothing worth jumping.

    `output_ids` are the request's output tokens, all accepted by `state` (the last one may
    not have been through the model yet). `max_new_tokens` caps `net_new_tokens` (pass the
    request's remaining budget); `max_jump_tokens` caps `append_ids`. The state is not
    modified. Only call it for grammars whose forced text is finite (see module docstring).
    `cache` (optional) remembers re-tokenized boundaries across calls.
    """
    matcher = state.matcher
    if matcher.is_terminated() or max_jump_tokens < 1:
        return None
    if max_new_tokens is not None and max_new_tokens < 1:
        return None
    forced = matcher.find_jump_forward_string()
    if len(forced) < min_chars:
        return None
    forced = forced[: max_jump_tokens * _CHARS_PER_TOKEN]  # a prefix of forced text is forced

    cache = cache if cache is not None else BoundaryCache()
    boundary = _anchored_boundary(tokenizer, output_ids, state.num_accepted, forced,
                                  max_boundary_tokens, cache)
    if boundary is None:
        return None
    tail, boundary_text, retokenized, kept = boundary
    rollback = len(tail) - kept
    candidate = retokenized[kept:]

    keep = max_jump_tokens
    if max_new_tokens is not None:
        keep = min(keep, max_new_tokens + rollback)
    fork, candidate = _walk_candidate(matcher, state, rollback, candidate, keep)

    # Rolled-back text must be re-covered, or already-streamed text would shrink; and some
    # forced text must be covered, or the jump saves no decode step.
    covered = cache.text(tokenizer, retokenized[: kept + len(candidate)])
    if len(covered) <= len(boundary_text) or not covered.startswith(boundary_text):
        return None
    return JumpPlan(
        rollback=rollback,
        append_ids=tuple(candidate),
        forced_text=forced,
        boundary_kept=kept,
        base_accepted=state.num_accepted,
        matcher=fork,
    )


def apply_plan(state: ConstraintState, plan: JumpPlan) -> None:
    """Commit a plan to the state: afterwards it has accepted the jumped-to tokens."""
    if plan.base_accepted != state.num_accepted:
        raise ValueError(
            f"stale jump plan: planned at {plan.base_accepted} accepted tokens, "
            f"state has {state.num_accepted}"
        )
    if plan.matcher is not None:
        # The fork already walked rollback + append; adopting it saves re-walking.
        state.matcher = plan.matcher
        object.__setattr__(plan, "matcher", None)  # a plan is applied at most once
    else:
        state.matcher.rollback(plan.rollback)
        for i, token in enumerate(plan.append_ids):
            if not state.matcher.accept_token(token):
                state.matcher.rollback(i)
                raise ValueError(f"jump plan token {token} rejected by the grammar")
    state.num_accepted += plan.net_new_tokens
    state.num_jumps += 1
    state.num_jump_tokens += plan.net_new_tokens


def _anchored_boundary(
    tokenizer: Any, output_ids: Sequence[int], num_accepted: int, forced: str, window: int,
    cache: BoundaryCache,
) -> _Boundary | None:
    """`_retokenize_boundary` over a window of output tokens whose first token survives
    re-tokenization (the anchor); None when there is none."""
    usable = min(len(output_ids), num_accepted)
    # If the first window token changes (no anchor), the merge may reach further left: widen
    # the window once before giving up.
    for size in (window, 2 * window):
        k = min(size, usable)
        boundary = cache.boundary(tokenizer, tuple(output_ids[len(output_ids) - k :]) if k else (), forced)
        if boundary is None:
            return None
        tail, _, _, kept = boundary
        if kept > 0 or len(tail) >= len(output_ids):
            return boundary
        if size >= usable:
            return None
    return None


def _walk_candidate(
    matcher: xgr.GrammarMatcher, state: ConstraintState, rollback: int, candidate: Sequence[int],
    keep: int,
) -> tuple[xgr.GrammarMatcher, Sequence[int]]:
    """Walk a fork of the matcher over the candidate tokens; returns the fork and the tokens
    to append: those the grammar accepts, less the held-back boundary token, at most `keep`."""
    fork = matcher.fork()
    if rollback:
        fork.rollback(rollback)
    accepted = 0
    for token in candidate:
        if not fork.accept_token(token):
            break
        accepted += 1
    if accepted < len(candidate):
        # Cannot happen for text the grammar accepts, unless a token is special; the last
        # accepted token may then sit on a boundary, so hold it back below.
        candidate = candidate[:accepted]
        ends_grammar = False
    else:
        ends_grammar = _only_stop_allowed(fork, state)
    if not ends_grammar and candidate:
        # Hold back the boundary token: the model may merge it with what it writes next.
        fork.rollback(1)
        candidate = candidate[:-1]
    if len(candidate) > keep:
        fork.rollback(len(candidate) - keep)
        candidate = candidate[:keep]
    return fork, candidate


def _only_stop_allowed(matcher: xgr.GrammarMatcher, state: ConstraintState) -> bool:
    from sgl.backend.grammar import _allows_only_stop

    if not matcher.is_completed():
        return False
    return _allows_only_stop(matcher, state.vocab_size, state.stop_token_ids)


def _retokenize_boundary(tokenizer: Any, tail: tuple[int, ...], forced: str) -> _Boundary | None:
    """Re-tokenize the text of the window's ids `tail` plus the forced string.

    Returns (tail ids, their text, re-tokenized ids, how many tail ids survive).
    """
    tail = tuple(int(t) for t in tail)
    # Drop leading tokens that start inside a UTF-8 character: their text alone is not valid.
    while tail and "\ufffd" in decode_ids(tokenizer, tail):
        tail = tail[1:]
    boundary_text = decode_ids(tokenizer, tail) if tail else ""
    text = boundary_text + forced
    retokenized = tuple(encode_text(tokenizer, text))
    if decode_ids(tokenizer, retokenized) != text:
        return None  # the tokenizer normalises this text: we cannot reason about boundaries
    return tail, boundary_text, retokenized, common_prefix_len(tail, retokenized)
