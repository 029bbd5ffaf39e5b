"""Incremental detokenizer with the real default-model tokenizer (StopChecker: test_stop_checker.py)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl.backend.detokenizer import IncrementalDetokenizer

HYPO = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Characters that stress byte-level BPE: multi-byte UTF-8 (2, 3 and 4 bytes), combining marks,
# runs of spaces and newlines, punctuation that merges with spaces.
ALPHABET = st.sampled_from(
    list("abcxyz ABC  \n\n\t.,!?'\"-_0123456789")
    + list("éèüñçÅøß") + ["e\u0301", "\u00a0"]  # accents, a combining mark, NBSP
    + list("中文字日本語한국어") + list("👋🙂🚀🇫🇷") + ["👨‍👩‍👧", "\u200b", "\ufeff"]
)  # fmt: skip
TEXT = st.lists(ALPHABET, max_size=40).map("".join)


@pytest.fixture(scope="module")
def tok(default_tokenizer: Any) -> Any:
    return default_tokenizer


def stream(detok: IncrementalDetokenizer, ids: list[int], cuts: list[int], full: str) -> str:
    """Push ids in groups whose sizes come from `cuts` (cycled); return all deltas + flush."""
    out, i, k = [], 0, 0
    while i < len(ids):
        n = cuts[k % len(cuts)] if cuts else 1
        out.append(detok.push(ids[i : i + n]))
        # A replacement character is never streamed unless the final text has one.
        assert "\ufffd" not in out[-1] or "\ufffd" in full
        i, k = i + n, k + 1
    out.append(detok.flush())
    return "".join(out)


def decode(tok: Any, ids: list[int], skip: bool = True) -> str:
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


@HYPO
@given(text=TEXT, cuts=st.lists(st.integers(1, 4), max_size=6))
def test_deltas_concatenate_to_the_decode_of_text(tok: Any, text: str, cuts: list[int]) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    full = decode(tok, ids)
    assert stream(IncrementalDetokenizer(tok), ids, cuts, full) == full


@HYPO
@given(
    ids=st.lists(st.one_of(st.integers(0, 48), st.integers(0, 49151), st.sampled_from([0, 1, 2])), max_size=30),
    cuts=st.lists(st.integers(1, 3), max_size=5),
    skip=st.booleans(),
)
def test_deltas_concatenate_for_arbitrary_ids(tok: Any, ids: list[int], cuts: list[int], skip: bool) -> None:
    # Random ids include special tokens and lone bytes that never form valid UTF-8.
    full = decode(tok, ids, skip)
    assert stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids, cuts, full) == full


def test_multibyte_characters_are_held_until_complete(tok: Any) -> None:
    ids = tok.encode("a👋b", add_special_tokens=False)
    assert len(ids) > 3  # the emoji spans several byte tokens
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "a👋b" and "👋" in deltas


def test_prompt_tail_gives_word_initial_spaces(tok: Any) -> None:
    prompt = tok.encode("<|im_start|>assistant\nSure, the", add_special_tokens=False)
    out = tok.encode(" answer is 42.", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt[-4:])
    text = "".join(detok.push([i]) for i in out) + detok.flush()
    assert text == " answer is 42."
    assert detok.output_ids == out


def test_long_streams_slide_the_window(tok: Any) -> None:
    text = "Résumé 中文 👋 " * 40 + "end"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push([i]) for i in ids) + detok.flush() == text
    assert len(detok._ids) - detok._start <= 17  # the decoded window stays small


def test_special_tokens_kept_when_not_skipped(tok: Any) -> None:
    ids = tok.encode("hi", add_special_tokens=False) + [2] + tok.encode(" there", add_special_tokens=False)
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tok)
    assert "".join(kept.push([i]) for i in ids) == "hi<|im_end|> there"
    assert "".join(skipped.push([i]) for i in ids) == "hi there"


def test_rollback_then_retokenised_ids_emit_only_new_text(tok: Any) -> None:
    # Jump-forward: `{"name_of_th` was streamed token by token; the grammar then forces
    # `{"name_of_the_field": `, re-tokenised, replacing the last tokens. Varying the number of
    # tokens before makes some rollbacks reach back past the window start.
    sampled = tok.encode('{"name_of_th', add_special_tokens=False)
    forced = tok.encode('{"name_of_the_field": "', add_special_tokens=False)
    crossed = 0
    for head_len in range(24):
        head = tok.encode("x" * 2 + " filler" * 40, add_special_tokens=False)[:head_len]
        detok = IncrementalDetokenizer(tok)
        text = "".join(detok.push([i]) for i in head + sampled)
        crossed += len(detok._ids) - detok._start < len(sampled)
        detok.rollback(len(sampled))
        text += detok.push(forced[:1]) + detok.push(forced[1:]) + detok.flush()
        assert text == decode(tok, head + forced), head_len
        assert detok.output_ids == head + forced
    assert crossed  # some rollbacks reached past the decoded window


class FakeSentencePiece:
    """Decodes like a Llama SentencePiece tokenizer: '▁' is a space, byte-fallback pieces are
    raw bytes, and the decoded string loses one leading space (so context matters)."""

    pieces = ["▁Hello", "▁world", ",", "▁the", "re", "▁there", "▁", "!", "\n", "<0xE2>", "<0x82>",
              "<0xAC>", "<0xF0>", "<0x9F>", "<0x91>", "<0x8B>", "é", "<s>"]  # fmt: skip
    special = {len(pieces) - 1}

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **_: Any) -> str:
        out = bytearray()
        for i in ids:
            piece = self.pieces[i]
            if i in self.special and skip_special_tokens:
                continue
            if piece.startswith("<0x") and len(piece) == 6:
                out.append(int(piece[3:5], 16))
            else:
                out += piece.replace("▁", " ").encode()
        text = out.decode("utf-8", errors="replace")
        return text[1:] if text.startswith(" ") else text


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, len(FakeSentencePiece.pieces) - 1), max_size=40),
    cuts=st.lists(st.integers(1, 4), max_size=6),
    tail=st.lists(st.integers(0, 8), max_size=4),
)
def test_sentencepiece_style_spaces_need_left_context(ids: list[int], cuts: list[int], tail: list[int]) -> None:
    sp = FakeSentencePiece()
    full = sp.decode(ids)
    assert stream(IncrementalDetokenizer(sp), ids, cuts, full) == full
    # With prompt context the first output token keeps its space, as it reads after the prompt.
    with_ctx = stream(IncrementalDetokenizer(sp, tail), ids, cuts, full)
    if "\ufffd" not in sp.decode(tail):
        assert sp.decode(tail) + with_ctx == sp.decode(tail + ids)


def test_sentencepiece_rollback_across_the_window() -> None:
    sp = FakeSentencePiece()
    crossed = 0
    for head_len in range(25):
        head = [0, 1, 2, 8][: head_len % 4] + [1] * head_len
        detok = IncrementalDetokenizer(sp)
        text = "".join(detok.push([i]) for i in head + [3, 4] * 4)  # "▁the", "re", ...
        crossed += len(detok._ids) - detok._start < 8
        detok.rollback(8)
        text += detok.push([5, 5]) + detok.push([5, 3]) + detok.push([4, 7]) + detok.flush()
        assert text == sp.decode(head + [5, 5, 5, 3, 4, 7]), head_len
    assert crossed
