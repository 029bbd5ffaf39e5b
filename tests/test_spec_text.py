"""The text-level n-gram drafter (backend/spec_text.py) on the default model's real tokenizer.

It matches the request's text, not its token ids, so a value copied from the prompt into JSON
(spelled there without its leading space, so with other tokens) is drafted from its first
token on; it drafts the text the grammar forces; its per-request state follows rollbacks.
The engine-level guarantee (same outputs with and without drafts) is tests/test_speculative.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sgl.backend.spec_text import PieceTable, TextDrafter
from sgl.backend.speculative import NgramDrafter, SpecConfig

PROMPT = "Extract name, age and city as JSON.\n\nText: Maria Lopez is 34 years old and lives in Lima."


@pytest.fixture(scope="module")
def tok(default_tokenizer: Any) -> Any:
    return default_tokenizer


@pytest.fixture(scope="module")
def table(tok: Any) -> PieceTable:
    t = PieceTable.from_tokenizer(tok)
    assert t is not None, "the default tokenizer's pieces must reproduce its text"
    return t


def _ids(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _req(tok: Any, prompt: str, output: str, constraint: Any = None) -> SimpleNamespace:
    return SimpleNamespace(prompt_ids=_ids(tok, prompt), output_ids=_ids(tok, output), constraint=constraint)


def _drafter(table: PieceTable, **kw: Any) -> TextDrafter:
    return TextDrafter(SpecConfig(num_draft_tokens=4), table, **kw)


def test_piece_table_spells_text_byte_for_byte_including_partial_characters(tok: Any, table: PieceTable) -> None:
    text = 'Ελλάδα, López & 日本語: {"k": [1, 2]}\n\tend'
    ids = _ids(tok, text)
    assert b"".join(table.pieces[t] for t in ids) == text.encode("utf-8")
    # some of those tokens are single bytes of a multi-byte character: not valid UTF-8 alone
    assert any(not _valid_utf8(table.pieces[t]) for t in ids)
    assert table.pieces[tok.convert_tokens_to_ids("<|im_end|>")] == b"\x00"  # specials separate


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_a_copied_json_value_is_drafted_from_its_first_token(tok: Any, table: PieceTable) -> None:
    """`"Maria` in the output is not the prompt's ` Maria` token, so id lookup finds nothing
    to follow it; the text `Maria` does occur, followed by ` Lopez is 34`."""
    r = _req(tok, PROMPT, '{"name": "Maria')
    drafts = _drafter(table).propose(r, 4)
    assert tok.convert_ids_to_tokens(drafts) == ["ĠLopez", "Ġis"]  # a 5-byte match: 2 drafts
    token_level = NgramDrafter(SpecConfig(num_draft_tokens=4, min_window=1, max_window=4)).propose(r, 4)
    assert token_level[:1] != drafts[:1], "the id lookup should not find the value (else this test shows nothing)"


def test_longer_matches_draft_more_tokens(tok: Any, table: PieceTable) -> None:
    d = _drafter(table)
    assert len(d.propose(_req(tok, PROMPT, '{"text": "Maria Lopez is 34'), 4)) == 4  # 17 bytes
    assert len(d.propose(_req(tok, PROMPT, '{"text": "Maria Lopez'), 3)) == 3  # the caller's limit
    assert len(d.propose(_req(tok, PROMPT, '{"x": "Lim'), 4)) == 1  # 3 bytes: one token
    assert d.propose(_req(tok, PROMPT, '{"x": "Li'), 4) == []  # 2 bytes: too weak to draft


def test_a_match_ending_inside_a_word_drafts_the_rest_of_it(tok: Any, table: PieceTable) -> None:
    # the output stopped inside the copied word: drafts start exactly after its last token
    r = _req(tok, PROMPT, '{"city": "Li')
    drafts = _drafter(table, min_chars=1, bytes_per_draft=0).propose(r, 2)
    assert [table.pieces[t] for t in drafts] == [b"ma", b"."]  # `Lima.`: the rest of the word


def test_no_match_no_draft_and_a_partial_character_drafts_nothing(tok: Any, table: PieceTable) -> None:
    d = _drafter(table)
    assert d.propose(_req(tok, "abc", "xyz"), 4) == []
    prompt = "Country: Ελλάδα and more text."
    lead = _ids(tok, "Ελλάδα")[0]  # the first byte of 'Ε' alone
    assert not _valid_utf8(table.pieces[lead])
    r = SimpleNamespace(prompt_ids=_ids(tok, prompt), output_ids=_ids(tok, "Country: ") + [lead], constraint=None)
    assert d.propose(r, 4) == []  # the continuation starts inside a character: no guess


def test_the_state_follows_appends_and_rollbacks(tok: Any, table: PieceTable) -> None:
    d = _drafter(table)
    r = _req(tok, PROMPT, '{"name": "Maria')
    first = d.propose(r, 4)
    calls = d.tokenizer_calls
    # accepting two drafted tokens lands on a token boundary of the cached continuation
    r.output_ids += first[:2]
    assert d.propose(r, 2) == _ids(tok, " Lopez is 34 years")[2:4]
    assert d.tokenizer_calls == calls, "the cached continuation should have been reused"
    # jump-forward re-tokenized the tail: the drafter's text must follow (same as a fresh one)
    r.output_ids[:] = _ids(tok, '{"name": "Maria Lopez", "city": "Li')
    assert d.propose(r, 3) == _drafter(table).propose(r, 3)
    del r.output_ids[-3:]  # rolled back below what was indexed (`..., "city` is left)
    assert d.propose(r, 3) == _drafter(table).propose(r, 3) != []
    d.forget(r)
    assert not d._text


class _Forcing:
    """A grammar state whose forced continuation is fixed (the engine's is xgrammar's)."""

    def __init__(self, forced: str, bound: int | None = 64) -> None:
        self.compiled = SimpleNamespace(forced_bound=bound)
        self.matcher = SimpleNamespace(find_jump_forward_string=lambda: self._query(forced),
                                       is_terminated=lambda: False)

    def _query(self, forced: str) -> str:
        assert self.compiled.forced_bound is not None, "asked an unbounded grammar for its forced text"
        return forced


def test_forced_text_is_drafted_then_what_followed_it(tok: Any, table: PieceTable) -> None:
    r = _req(tok, PROMPT, '{"name": "Maria Lopez", "age": 34, "city', _Forcing('": "'))
    drafts = _drafter(table).propose(r, 4)
    forced = _ids(tok, '": "')
    assert drafts[: len(forced)] == forced
    # the output plus the forced text ends in `: "`, last seen before `Maria` in the output
    assert drafts[len(forced)] == _ids(tok, '": "Maria')[len(forced)]
    # an unbounded grammar is never asked (xgrammar's query might not return): text drafts only
    unbounded = _req(tok, PROMPT, '{"name', _Forcing('": "', bound=None))
    assert _drafter(table).propose(unbounded, 4) == _drafter(table).propose(_req(tok, PROMPT, '{"name'), 4)


def test_a_tokenizer_whose_pieces_do_not_spell_its_text_gets_no_table(tok: Any) -> None:
    assert PieceTable.from_tokenizer(None) is None
    # pieces that drop the word-initial space marker: the probe round trip fails
    broken = SimpleNamespace(convert_ids_to_tokens=lambda ids: [tok.convert_ids_to_tokens(i).lstrip("Ġ") for i in ids],
                             added_tokens_decoder=tok.added_tokens_decoder, all_special_ids=tok.all_special_ids,
                             backend_tokenizer=tok.backend_tokenizer)
    assert PieceTable.from_tokenizer(_Sized(broken, len(tok))) is None


class _Sized:
    def __init__(self, inner: Any, n: int) -> None:
        self._inner, self._n = inner, n

    def __len__(self) -> int:
        return self._n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
