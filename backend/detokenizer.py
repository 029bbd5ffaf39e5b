"""Incremental detokenization and stop strings: token ids in, stream text deltas out.

Decoding each new token alone is wrong twice over: a multi-byte UTF-8 character may be split
across byte-level tokens (alone each decodes to U+FFFD), and SentencePiece drops the leading
space of the first token of a decode. So each request keeps a small window of recent ids and
decodes the whole window every push; the delta is the window text past what was already
emitted::

    ids:     | prompt tail | o0 o1 ... | o(k-6) ... o(k-1) | new |
                                       |<------- window -------->|   decoded every push
    window text: |<-- already emitted (`emitted` chars) -->|<-- delta -->|

The window slides forward (re-measuring `emitted`) once it is a few tokens long, and a push
whose text ends in U+FFFD emits nothing until the character's remaining bytes arrive. A
window's text only ever grows at its end (byte-level BPE and SentencePiece decode
concatenatively past their first token), so the deltas concatenate to the full decode.

`StopChecker` then runs on the delta stream and holds back any suffix that could still become
a stop string, so a stop string never leaks into streamed text. Stop token ids and EOS are the
engine's business, not this module's.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["IncrementalDetokenizer", "StopChecker"]

_CONTEXT = 5  # tokens of left context kept when the window slides
_MAX_WINDOW = 16  # slide once the window holds this many tokens


class IncrementalDetokenizer:
    """One request's detokenizer. `push` each step's new ids, `flush` at the end.

    `prompt_ids_tail`: the last few prompt ids, decoded as left context only (never emitted),
    so the first output token gets its word-initial space as it would after the prompt.
    Without it, the deltas concatenate to `tokenizer.decode(output_ids, skip_special_tokens)`.
    Decodes pass `clean_up_tokenization_spaces=False`: clean-up rewrites text already emitted.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids_tail: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        # A fast tokenizer's own `tokenizers.Tokenizer` decodes the same text at about half the
        # cost of the transformers wrapper (argument conversion, batch checks), on every
        # streamed token; it takes no clean-up (off here) and, like the fast wrapper, has no
        # spaces_between_special_tokens (only slow tokenizers apply it).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._skip_special = skip_special_tokens
        self._decode_kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
            "clean_up_tokenization_spaces": False,
        }
        tail = list(prompt_ids_tail or ())
        tail_text = self._decode(tail)
        if "\ufffd" in tail_text:
            tail, tail_text = [], ""  # the tail cuts a character: context would garble output
        self._ids: list[int] = tail  # prompt tail + every output id
        self._num_context = len(tail)
        self._start = 0  # window start in `_ids`
        self._emitted = len(tail_text)  # chars of the window's text already emitted (or context)

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=self._skip_special)
        return self.tokenizer.decode(list(ids), **self._decode_kwargs)

    def push(self, new_ids: Sequence[int]) -> str:
        """Append ids; return the text they complete (possibly "", never a partial character)."""
        self._ids.extend(new_ids)
        text = self._decode(self._ids[self._start :])
        if text.endswith("\ufffd"):
            return ""  # a character's bytes are still arriving (or the model emitted U+FFFD)
        if len(text) < self._emitted:
            return ""  # after a rollback: the new ids have not re-covered the emitted text yet
        delta = text[self._emitted :]
        self._emitted = len(text)
        if len(self._ids) - self._start > _MAX_WINDOW:
            self._start = len(self._ids) - _CONTEXT
            # The window may now begin inside a character (leading U+FFFD); every later decode
            # of this window begins the same way, so counting characters stays consistent.
            self._emitted = len(self._decode(self._ids[self._start :]))
        return delta

    def flush(self) -> str:
        """The text held back at the end of the request (a dangling partial character)."""
        text = self._decode(self._ids[self._start :])
        delta = text[self._emitted :]
        self._emitted = max(self._emitted, len(text))
        return delta

    def rollback(self, n: int) -> None:
        """Forget the last n output ids (jump-forward re-tokenisation).

        Their text may already be out; the ids that replace them must decode to a string that
        starts with it, and only what goes beyond is emitted."""
        if n <= 0:
            return
        keep = len(self._ids) - n
        assert keep >= self._num_context, "cannot roll back into the prompt"
        start = max(0, keep - _CONTEXT)
        if start < self._start:
            # Re-anchor the window further left so the replacement ids keep their context.
            # The not-yet-emitted suffix has the same length under either window.
            pending = len(self._decode(self._ids[self._start :])) - self._emitted
            self._emitted = len(self._decode(self._ids[start:])) - pending
            self._start = start
        del self._ids[keep:]


class StopChecker:
    """Cuts a text stream at the first stop string.

    `feed(delta) -> (text to emit, matched stop or None)`. Text that might be the start of a
    stop string is held back until it is ruled out (or `flush` releases it at the end). The
    match is the stop string that ends first in the text (the longest one on a tie), which is
    what a character-by-character check would find, so chunking never changes the result.
    """

    def __init__(self, stop: Sequence[str], no_stop_trim: bool = False) -> None:
        self.stop = tuple(s for s in stop if s)
        self.no_stop_trim = no_stop_trim
        self.matched: str | None = None
        self._held = ""
        self._longest = max((len(s) for s in self.stop), default=0)

    def feed(self, delta: str) -> tuple[str, str | None]:
        if self.matched is not None:
            return "", None  # already stopped: the engine finishes the request
        text = self._held + delta
        # No stop string lies wholly inside `_held`, so any match ends in the new text.
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for s in self.stop:
            i = text.find(s)
            if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
                best = (i + len(s), -len(s), s)
        if best is not None:
            end, neg_len, s = best
            self.matched, self._held = s, ""
            return text[: end if self.no_stop_trim else end + neg_len], s
        hold = self._partial_len(text)
        self._held = text[len(text) - hold :]
        return text[: len(text) - hold], None

    def _partial_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for n in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def flush(self) -> str:
        """Release held-back text when the request ends for another reason."""
        held, self._held = self._held, ""
        return held
