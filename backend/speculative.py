"""N-gram speculative decoding (prompt lookup): drafts from the request's own tokens.

A decoding request whose last few tokens also occur earlier in its prompt or output is likely
to continue the way it continued there (extraction copies values from the prompt; code and
JSON repeat keys). The drafter proposes the tokens that followed the most recent earlier
occurrence of the longest matching suffix (between `min_window` and `max_window` tokens).

Verification runs on the same multi-token decode step as jump-forward: the request computes
[last token, d1 .. dk] in one step and samples at every one of those positions, row j with the
seed step and grammar mask that decoding would have used at that output position. Draft
d(j+1) is accepted while it equals the sample of row j; the first mismatch's sample is the
correction. So greedy and seeded outputs are token for token those of decoding without
speculation: each accepted token *is* the token decoding would have sampled.

With a grammar, a draft is cut before the first token the grammar rejects, and each row's mask
is the matcher's state after the drafts before it (a forked matcher walks them; the request's
own matcher only ever accepts the tokens that were kept).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from sgl.backend.req import Req

__all__ = ["NgramDrafter", "SpecConfig", "SpecStats", "accepted_len", "cut_to_grammar", "draft_states"]


@dataclass(frozen=True)
class SpecConfig:
    """The engine's speculative options (SGLang's names, `speculative_*`)."""

    num_draft_tokens: int = 4  # tokens proposed per step (verified in one step)
    min_window: int = 1  # shortest suffix that may match
    max_window: int = 4  # longest suffix tried first
    disable_by_batch_size: int | None = None  # no drafts while more requests decode (None: any)

    def drafts_at(self, decoding: int) -> bool:
        """Whether a step in which `decoding` requests decode proposes drafts."""
        return self.disable_by_batch_size is None or decoding <= self.disable_by_batch_size


@dataclass
class SpecStats:
    """Lifetime counters: acceptance = accepted / proposed."""

    steps: int = 0  # request-steps that verified a draft
    proposed: int = 0
    accepted: int = 0


@dataclass
class _Index:
    """Where each n-gram of a request's tokens last ended, for every window size."""

    length: int = 0  # tokens indexed so far
    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)


class NgramDrafter:
    """Proposes drafts for decoding requests; keeps one incremental index per request."""

    def __init__(self, cfg: SpecConfig) -> None:
        self.cfg = cfg
        self.stats = SpecStats()
        self._index: dict[int, _Index] = {}  # id(req) -> index

    def forget(self, r: Req) -> None:
        self._index.pop(id(r), None)

    def propose(self, r: Req, limit: int) -> list[int]:
        """Up to `limit` draft tokens to follow `r`'s known tokens, or [] without a match."""
        if limit < 1:
            return []
        tokens = r.prompt_ids + r.output_ids
        index = self._index.setdefault(id(r), _Index())
        if index.length > len(tokens):  # outputs were rolled back: rebuild
            index = self._index[id(r)] = _Index()
        # Index every n-gram ending before the last token (the suffix must match elsewhere).
        lo, hi = self.cfg.min_window, self.cfg.max_window
        for end in range(max(index.length, lo), len(tokens)):
            for w in range(lo, min(hi, end) + 1):
                index.last_end[tuple(tokens[end - w : end])] = end
        index.length = len(tokens)
        for w in range(min(hi, len(tokens) - 1), lo - 1, -1):
            end = index.last_end.get(tuple(tokens[len(tokens) - w :]))
            if end is not None:
                return tokens[end : end + limit]
        return []


def accepted_len(drafts: Sequence[int], samples: Sequence[int]) -> int:
    """How many drafts the samples confirm: samples[j] is what decoding would have produced
    after drafts[:j], so drafts[j] stands while it equals samples[j]."""
    n = 0
    while n < len(drafts) and drafts[n] == samples[n]:
        n += 1
    return n


def cut_to_grammar(state: Any, drafts: list[int]) -> list[int]:
    """The longest prefix of `drafts` the request's grammar accepts (its state unchanged)."""
    fork = state.matcher.fork()
    for i, token in enumerate(drafts):
        if fork.is_terminated() or not fork.accept_token(token):
            return drafts[:i]
    return drafts


def draft_states(state: Any, drafts: Sequence[int]) -> list[Any]:
    """The grammar state each verify row after the first samples under: row j sees the
    request's state after drafts[:j] (copies over forked matchers; drafts already cut to what
    the grammar accepts). The request's own state is row 0 and stays unchanged."""
    rows = []
    fork = state.matcher
    for token in drafts:
        fork = fork.fork()
        accepted = fork.accept_token(token)
        assert accepted, "drafts are cut to the grammar before they are scheduled"
        row = copy.copy(state)
        row.matcher = fork
        rows.append(row)
    return rows
