"""Stopping at a regex match in the output text, streaming included.

`RegexStopChecker` has `StopChecker`'s interface (`feed(delta) -> (text to emit, matched or
None)`, then `flush()`), so a request's text goes through the stop strings first and the stop
regexes next (`StopChain`), and the scheduler sees one checker.

Why the `regex` module and not `re`: streamed text must never include what a later match would
cut. That needs to know, after each token, where a match *could still start* once more text
arrives, which is `regex`'s partial matching (`search(..., partial=True)`); `re` can only say
whether a match exists now. Text from the earliest possible start on is held back::

    pattern  "Answer: \\d"        text so far  "The Answer: "
    complete match?  no          partial match starts at 4  ->  emit "The ", hold "Answer: "
    next delta "4."              "Answer: 4." matches at 0  ->  emit "" (cut), matched

The search runs on the engine thread, so it is given a time budget: a pattern that backtracks
catastrophically (`(a+)+b` on a long run of `a`) and takes longer than `SEARCH_TIMEOUT` on one
token's text ends the request there, as if it had matched at the start of the text not yet
released (nothing it could cut was streamed), with a warning in the log. It never hangs the engine.

A complete match ends the request at once, as SGLang checks after every token: a pattern
that could match more (`\\d+`) stops at the first text it matches; end it with a terminator
(`\\d+\\n`) to capture more. The match reported is the pattern itself (SGLang's
`matched` for a stop regex).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

__all__ = ["RegexStopChecker", "StopChain", "SEARCH_TIMEOUT"]

logger = logging.getLogger("sgl.engine")
# Seconds one pattern's search may take per token; ordinary patterns take microseconds.
SEARCH_TIMEOUT = 0.1

# Released characters kept as context, so that lookbehinds and \b see the text before the
# held part (a match never starts there: it would have been held).
_CONTEXT = 64


class RegexStopChecker:
    """Cuts a text stream at the first match of any of `patterns` (already validated)."""

    def __init__(self, patterns: Sequence[str], no_stop_trim: bool = False) -> None:
        import regex

        self.patterns = tuple(patterns)
        self._compiled = [regex.compile(p) for p in self.patterns]
        self.no_stop_trim = no_stop_trim
        self.matched: str | None = None
        self._held = ""
        self._context = ""  # the last released characters

    def feed(self, delta: str) -> tuple[str, str | None]:
        if self.matched is not None:
            return "", None  # already stopped: the engine finishes the request
        text = self._held + delta
        if not text:
            return "", None
        buf, pos = self._context + text, len(self._context)
        best: tuple[int, int, str] | None = None  # (start, -end, pattern): earliest, then longest
        hold = len(text)
        for pattern, compiled in zip(self.patterns, self._compiled):
            try:
                m = compiled.search(buf, pos, timeout=SEARCH_TIMEOUT)
                partial = compiled.search(buf, pos, partial=True, timeout=SEARCH_TIMEOUT)
            except TimeoutError:
                logger.warning("stop_regex %r took over %ss on %d characters; stopping the request",
                               pattern, SEARCH_TIMEOUT, len(text))
                best = (0, 0, pattern)  # release none of the unchecked text
                break
            if m is not None:
                key = (m.start() - pos, -(m.end() - pos), pattern)
                best = key if best is None or key < best else best
            if partial is not None and partial.partial:
                hold = min(hold, partial.start() - pos)
        if best is not None:
            start, neg_end, pattern = best
            self.matched, self._held = pattern, ""
            return text[: -neg_end if self.no_stop_trim else start], pattern
        self._held = text[hold:]
        return self._release(text[:hold]), None

    def _release(self, out: str) -> str:
        if out:
            self._context = (self._context + out)[-_CONTEXT:]
        return out

    def flush(self) -> str:
        """Release held-back text when the request ends for another reason."""
        held, self._held = self._held, ""
        return held


class StopChain:
    """Stop strings, then stop regexes: text released by the first goes through the second.

    A request ends at whichever cuts first in the text; held-back text of either is released
    by `flush` when the request ends otherwise."""

    def __init__(self, strings: Any, regexes: RegexStopChecker) -> None:
        self.strings, self.regexes = strings, regexes

    @property
    def matched(self) -> str | None:
        return self.regexes.matched or self.strings.matched

    def feed(self, delta: str) -> tuple[str, str | None]:
        text, matched = self.strings.feed(delta)
        out, regex_matched = self.regexes.feed(text)
        if regex_matched is not None:
            return out, regex_matched
        if matched is not None:  # the stop string ended it: nothing more can match
            return out + self.regexes.flush(), matched
        return out, None

    def flush(self) -> str:
        out, matched = self.regexes.feed(self.strings.flush())
        return out if matched is not None else out + self.regexes.flush()
