"""Text-level n-gram drafts: match the request's *text*, then tokenize what followed.

Token-id lookup (`speculative.NgramDrafter`) misses the commonest copy of all. A value copied
from the prompt into JSON is spelled without the leading space it has in the prompt, so its
tokens differ from the prompt's::

    prompt:  ... 'Text' ':' ' Maria' ' Garcia' ' is' ...
    output:  ... ' "' 'Maria'                          <- no token of the output's tail occurs
                                                          in the prompt: no id-level match

In bytes the output ends with `Maria`, which does occur in the prompt, followed by
` Garcia is ...`. So this drafter keeps each request's text as bytes (prompt, then output),
finds the longest suffix of `min_chars`..`max_chars` bytes that occurred earlier (the latest
occurrence), tokenizes the bytes that followed it with the tokenizer's own encoder, and
proposes the first tokens. The continuation starts exactly after the request's last token, so
the tokens drafted are those the model writes next when it keeps copying; a continuation that
starts inside a UTF-8 character (the last token was a partial byte) drafts nothing. A match of
n bytes drafts at most ceil(n / `bytes_per_draft`) tokens: a short match is weak evidence, and
each verify row costs a share of a step (on the CPU about a third; with a grammar, a mask).

A constrained request first gets the text its grammar forces next (xgrammar's forced string,
tokenized canonically): with jump-forward on, the boundary token the jump held back (` "`
before a string value) and forced text too short to jump (`\n}` at the end); with it off, all
forced text. The match then runs on the output followed by that forced text.

Per step and request the cost is a few `bytearray.rfind` calls (binary search over the match
length: a suffix of length L occurring ending at e implies the suffix of length L-1 does too)
and a dict lookup; the tokenizer runs only when a match is found at a position not tokenized
before. Consecutive steps that keep copying from one source hit the cached tokenization: the
match end advances over the accepted tokens' bytes, which are token boundaries of the cache.

Token bytes come from a table built once per engine (`PieceTable`): byte-level BPE pieces map
back through the GPT-2 byte alphabet (tokens may be partial UTF-8), SentencePiece pieces map
`\u2581` to a space and `<0xNN>` to the byte. Special tokens are a separator byte that never
starts a continuation. A tokenizer the table cannot reproduce (checked on a probe text at
construction) gets no text drafting: the token-id lookup alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from sgl.backend.speculative import NgramDrafter, SpecConfig
from sgl.backend.tokenizer import encode_text

if TYPE_CHECKING:
    from sgl.backend.req import Req

__all__ = ["PieceTable", "TextDrafter"]

# Chosen on the `json` workload's prompts (free text and JSON, replayed offline against greedy
# outputs, and bench/speculative.py): on the CPU a verify row costs about a third of a step.
MIN_MATCH_BYTES = 3  # shorter suffixes ("e", "s ") match everywhere and mostly draft wrong
MAX_MATCH_BYTES = 32  # longest suffix tried: longer ones rarely pick another source
BYTES_PER_DRAFT = 4  # a match of n bytes drafts at most ceil(n / 4) tokens: short, weak, few

_SEPARATOR = b"\x00"  # a special token's bytes: matches nothing useful, ends a continuation
_RECHECK = 8  # output ids compared per step to notice a rollback (jump-forward re-tokenizes <= 8)
_PROBE = 'Extract "Maria López" (34), 1,284.50 GBP\n  {"a": [1, 2]}\tend.'


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte, inverted: char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:  # unprintable bytes are shifted past 255, in byte order
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _sentencepiece_bytes(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])  # byte-fallback token
    return piece.replace("\u2581", " ").encode("utf-8")


@dataclass(frozen=True)
class PieceTable:
    """Every token id's bytes, and the tokenizer's encoder for continuations."""

    pieces: tuple[bytes, ...]
    encode: Callable[[str], list[int]]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> PieceTable | None:
        """The table for a transformers tokenizer, or None when its pieces do not concatenate to
        its text (the probe round trip fails): text drafting is then off."""
        if tokenizer is None:
            return None
        names = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        alphabet = _byte_level_alphabet()
        byte_level = all(c in alphabet for name in names[:2000] if name for c in name)
        special = {int(i) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
        special |= set(getattr(tokenizer, "all_special_ids", ()))
        pieces = []
        for i, name in enumerate(names):
            if i in special or name is None:
                pieces.append(_SEPARATOR)
            elif byte_level and all(c in alphabet for c in name):
                pieces.append(bytes(alphabet[c] for c in name))
            elif byte_level:  # an added, non-special token: its text as written
                pieces.append(name.encode("utf-8"))
            else:
                pieces.append(_sentencepiece_bytes(name))
        table = cls(tuple(pieces), functools.partial(encode_text, tokenizer))
        probe = _PROBE.encode("utf-8")
        return table if b"".join(table.pieces[t] for t in table.encode(_PROBE)) == probe else None


@dataclass
class _Continuation:
    """A tokenized continuation: ids[i] starts at byte position starts[i] of the request's
    text; reused while the match end lands on one of those starts."""

    ids: list[int]
    index_at: dict[int, int]  # byte position -> index of the token starting there
    end: int  # the bytes it was tokenized from end here; a rollback below invalidates it


@dataclass
class _TextState:
    """One request's text as bytes (prompt, then output) and what it was built from."""

    buf: bytearray
    prompt_bytes: int
    ids: list[int] = field(default_factory=list)  # output ids whose bytes are in buf
    ends: list[int] = field(default_factory=list)  # len(buf) after each of them
    cont: _Continuation | None = None


class TextDrafter(NgramDrafter):
    """Drafts the grammar's forced text, then what followed the longest matching text suffix.

    A subclass of the token-id drafter for its interface (`cfg`, `stats`, `propose`,
    `forget`), not its lookup: as a fallback where the text finds nothing, the id lookup
    drafted more and kept less (greedy outputs of the `json` workload replayed offline)."""

    def __init__(self, cfg: SpecConfig, table: PieceTable, *, min_chars: int = MIN_MATCH_BYTES,
                 max_chars: int = MAX_MATCH_BYTES, bytes_per_draft: int = BYTES_PER_DRAFT,
                 use_grammar: bool = True) -> None:
        super().__init__(cfg)
        self.bytes_per_draft = bytes_per_draft
        self.table = table
        self.min_chars, self.max_chars = min_chars, max_chars
        self.use_grammar = use_grammar  # draft forced text (off: to measure what it adds)
        self.tokenizer_calls = 0  # continuations tokenized (the rest came from the cache)
        self._text: dict[int, _TextState] = {}  # id(req) -> state

    def forget(self, r: Req) -> None:
        self._text.pop(id(r), None)

    def propose(self, r: Req, limit: int) -> list[int]:
        if limit < 1:
            return []
        st = self._sync(r)
        forced, forced_bytes = self._forced(r, limit)
        if forced:  # the grammar's forced text first, then what followed its match
            more = self._propose_text(st, limit - len(forced), forced_bytes) if len(forced) < limit else []
            return forced + (more or [])
        return self._propose_text(st, limit) or []

    def _forced(self, r: Req, limit: int) -> tuple[list[int], bytes]:
        """The canonical tokens of the text the request's grammar forces next, and its bytes.

        With jump-forward on, this is what the jump leaves to decoding: the held-back boundary
        token (` "` before a string value) and forced text too short to jump (`\n}` at the
        end); with it off, all forced text. Only for grammars whose forced text is bounded
        (the query may not return otherwise), the same condition jump-forward uses."""
        state = getattr(r, "constraint", None)
        if (state is None or not self.use_grammar or state.compiled.forced_bound is None
                or state.matcher.is_terminated()):
            return [], b""
        text = state.matcher.find_jump_forward_string()[: 16 * limit]
        if not text:
            return [], b""
        data = text.encode("utf-8")
        ids, size = self._checked(self.table.encode(text), data, 0)
        return ids[:limit], data[:size]

    def _sync(self, r: Req) -> _TextState:
        """The request's state with its bytes up to date (rolled-back outputs removed)."""
        st = self._text.get(id(r))
        if st is None:
            buf = bytearray(b"".join(self.table.pieces[t] for t in r.prompt_ids))
            st = self._text[id(r)] = _TextState(buf, len(buf))
        out, known = r.output_ids, len(st.ids)
        keep = min(known, len(out))
        lo = max(0, keep - _RECHECK)
        if st.ids[lo:keep] != out[lo:keep]:  # jump-forward replaced tokens we already hold
            keep = next(j for j in range(lo, keep) if st.ids[j] != out[j])
        if keep < known:
            new_len = st.ends[keep - 1] if keep else st.prompt_bytes
            del st.buf[new_len:], st.ids[keep:], st.ends[keep:]
            if st.cont is not None and st.cont.end > new_len:
                st.cont = None
        pieces, buf = self.table.pieces, st.buf
        for t in out[keep:]:
            buf += pieces[t]
            st.ids.append(t)
            st.ends.append(len(buf))
        return st

    def _propose_text(self, st: _TextState, limit: int, extra: bytes = b"") -> list[int] | None:
        """Drafts from the latest earlier occurrence of the longest text suffix; None when no
        suffix of `min_chars` bytes occurred before. `extra`: bytes that will follow the
        request's text (forced by the grammar); the cache is for the request's own text only."""
        buf = st.buf + extra if extra else st.buf
        match = self._match(buf)
        if match is None:
            return None
        start, length = match
        if self.bytes_per_draft:  # a short match is weak evidence: draft less after it
            limit = min(limit, -(-length // self.bytes_per_draft))
        if extra:
            return self._tokenize(buf, start, limit).ids[:limit]
        cont = st.cont
        if cont is not None and start in cont.index_at:
            i = cont.index_at[start]
            if len(cont.ids) - i >= limit:
                return cont.ids[i : i + limit]
        cont = st.cont = self._tokenize(st.buf, start, limit)
        return cont.ids[:limit]

    def _match(self, buf: bytearray) -> tuple[int, int] | None:
        """(where the text after the best match starts, the match's length in bytes): the
        longest suffix of min..max bytes with an earlier occurrence (its latest one), or None."""
        n = len(buf)
        lo, hi = self.min_chars, min(self.max_chars, n - 1)
        best = None
        while lo <= hi:  # a longer matching suffix implies every shorter one matches
            mid = (lo + hi) // 2
            pos = buf.rfind(buf[n - mid :], 0, n - 1)
            if pos >= 0:
                best, lo = (pos + mid, mid), mid + 1
            else:
                hi = mid - 1
        return best

    def _tokenize(self, buf: bytearray, start: int, limit: int) -> _Continuation:
        """The tokenizer's tokens for the bytes at `start`, minus the last one (the cut may
        split a word there); only tokens whose bytes reproduce the text are kept."""
        chunk = bytes(buf[start : start + 8 * limit + 16])  # ~4 bytes a token, and a margin
        chunk = chunk.split(_SEPARATOR, 1)[0]
        try:
            text = chunk.decode("utf-8")
        except UnicodeDecodeError as exc:  # cut before the first incomplete or invalid byte
            chunk = chunk[: exc.start]
            text = chunk.decode("utf-8")
        if not text:  # e.g. it starts inside a character (the last token was a partial byte):
            return _Continuation([], {}, start)  # the encoder cannot spell that
        self.tokenizer_calls += 1
        ids, _ = self._checked(self.table.encode(text)[:-1], buf, start)
        index_at, pos = {}, start
        for i, t in enumerate(ids):
            index_at[pos] = i
            pos += len(self.table.pieces[t])
        return _Continuation(ids, index_at, start + len(chunk))

    def _checked(self, ids: list[int], data: bytes | bytearray, start: int) -> tuple[list[int], int]:
        """The longest prefix of `ids` whose bytes spell `data` from `start` (an encoder that
        normalises text is trusted no further), and how many bytes it spells."""
        pos = start
        for i, t in enumerate(ids):
            piece = self.table.pieces[t]
            if data[pos : pos + len(piece)] != piece:
                return ids[:i], pos - start
            pos += len(piece)
        return ids, pos - start
