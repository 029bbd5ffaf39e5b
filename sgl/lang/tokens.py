"""A program's token sequence, kept beside its text so that each gen extends cached KV.

Invariants (checked by `check_integrity`, asserted in tests):

- `decode(ids) == text` (decoding with special tokens kept), after `flush()`.
- Text appended by the program is tokenized *at the boundary*: the last few tokens are decoded,
  joined with the new text and re-tokenized, so the result equals tokenizing the whole text
  (the window is widened until a wider window gives the same tail; see `_merge`).
- Generated tokens are kept as the model produced them (that is what the KV cache holds), even
  where the model chose a non-canonical split; only the tokens at the next text boundary are
  re-tokenized. Tokens the text does not show (a trimmed stop string, a skipped EOS) are dropped
  so the invariant above holds.

Window retokenization, with `|` the kept/retokenized split::

    ids:   [ ..... kept ..... | w1 w2 w3 w4 ]     text_new = "..."
    retok: tokenize(decode(w1..w4) + text_new)     accepted when it equals the tail of
           tokenize(decode(w-3..w4) + text_new)    (a window twice as wide)
"""

from __future__ import annotations

from typing import Protocol, Sequence

__all__ = ["Tokenizer", "TokenSequence", "merge_text", "special_prefix"]

_START_WINDOW = 4


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer this module uses."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def _encode(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _decode(tok: Tokenizer, ids: Sequence[int]) -> str:
    # Keep special tokens (role markers are text of the program) and never "clean up" spaces:
    # the decoded window must be byte-for-byte the end of the state's text.
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def special_prefix(tok: Tokenizer) -> list[int]:
    """The ids the tokenizer puts before any text (a BOS for Llama, nothing for SmolLM2)."""
    cached = getattr(tok, "_sgl_special_prefix", None)
    if cached is not None:
        return list(cached)
    with_sp = list(tok.encode("a", add_special_tokens=True))
    without = _encode(tok, "a")
    prefix = with_sp[: len(with_sp) - len(without)] if with_sp[len(with_sp) - len(without):] == without else []
    try:
        tok._sgl_special_prefix = tuple(prefix)  # type: ignore[attr-defined]
    except Exception:  # some tokenizers refuse new attributes; recomputing is cheap
        pass
    return prefix


def merge_text(tok: Tokenizer, ids: list[int], text: str, new_text: str, start: int = 0) -> list[int]:
    """Return the ids of `text + new_text`, keeping `ids[:k]` for the largest safe k.

    `ids[start:]` are the tokens of `text`; `ids[:start]` (the special prefix) are kept.
    """
    if not new_text:
        return list(ids)
    k = _START_WINDOW
    while True:
        cut = max(start, len(ids) - k)
        if cut == start:  # the window reached the start: tokenize everything
            return ids[:start] + _encode(tok, text + new_text)
        tail = _tail_text(tok, ids, text, cut)
        if tail is None:  # the window starts inside a multi-byte character: widen
            k += 1
            continue
        narrow = _encode(tok, tail + new_text)
        wide_cut = max(start, len(ids) - 2 * k)
        wide_tail = _tail_text(tok, ids, text, wide_cut)
        if wide_tail is not None:
            wide = _encode(tok, wide_tail + new_text)
            if len(wide) >= len(narrow) and wide[len(wide) - len(narrow) :] == narrow:
                return ids[:cut] + narrow
        k *= 2


def _tail_text(tok: Tokenizer, ids: list[int], text: str, cut: int) -> str | None:
    """Text of ids[cut:] if it is exactly the end of `text` (else the cut splits a char)."""
    tail = _decode(tok, ids[cut:])
    return tail if text.endswith(tail) and "\ufffd" not in tail[:1] else None


class TokenSequence:
    """Token ids and text of one program state; appended text is tokenized lazily."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._ids: list[int] = special_prefix(tokenizer)
        self._prefix_len = len(self._ids)  # ids[:prefix_len] are the special prefix (BOS)
        self._text = ""  # text of ids[prefix_len:]
        self._pending = ""  # appended but not yet tokenized: merged in one go at flush()

    def copy(self) -> TokenSequence:
        self.flush()
        twin = TokenSequence.__new__(TokenSequence)
        twin.tokenizer, twin._prefix_len = self.tokenizer, self._prefix_len
        twin._ids, twin._text, twin._pending = list(self._ids), self._text, ""
        return twin

    @property
    def text(self) -> str:
        return self._text + self._pending

    @property
    def ids(self) -> list[int]:
        """The tokens of `text` (flushes pending text). Do not mutate the returned list."""
        self.flush()
        return self._ids

    def append_text(self, text: str) -> None:
        self._pending += text

    def flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, ""
        if not self._text and self._starts_with_bos(pending):
            # The text carries its own BOS (a chat template that renders it): do not add another.
            self._ids, self._prefix_len = [], 0
        self._ids = merge_text(self.tokenizer, self._ids, self._text, pending, start=self._prefix_len)
        self._text += pending

    def preview(self, new_text: str) -> list[int]:
        """The ids `append_text(new_text)` would give, without changing this sequence."""
        self.flush()
        return merge_text(self.tokenizer, self._ids, self._text, new_text, start=self._prefix_len)

    def append_generated(self, token_ids: Sequence[int], text: str) -> None:
        """Append a generation: keep the model's tokens where they decode to a prefix of text."""
        self.flush()
        ids = list(token_ids)
        keep = len(ids)
        while keep > 0:
            shown = _decode(self.tokenizer, ids[:keep])
            if text.startswith(shown):
                break
            keep -= 1
        shown = _decode(self.tokenizer, ids[:keep]) if keep else ""
        self._ids.extend(ids[:keep])
        self._text += shown
        # The rest (normally nothing) is text the tokens did not cover: tokenize it normally.
        self.append_text(text[len(shown) :])

    def _starts_with_bos(self, text: str) -> bool:
        bos = getattr(self.tokenizer, "bos_token", None)
        return bool(bos) and self._prefix_len > 0 and text.startswith(bos)

    def check_integrity(self) -> None:
        self.flush()
        decoded = _decode(self.tokenizer, self._ids[self._prefix_len :])
        assert decoded == self._text, f"tokens decode to {decoded!r}, text is {self._text!r}"
