"""Token-level state with the real SmolLM2 tokenizer: the ids a program sends equal the
tokenization of its whole text; generated tokens are kept; select's token boundary."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sgl.lang as sgl
from sgl.lang import FakeBackend
from sgl.lang.chat import chat_template_from_tokenizer
from sgl.lang.tokens import TokenSequence

@pytest.fixture(scope="module")
def tok(default_tokenizer):  # noqa: ANN001, ANN201
    return default_tokenizer


def encode(tok, text: str) -> list[int]:  # noqa: ANN001
    return tok.encode(text, add_special_tokens=False)


PIECES = ["Hello", " world", "world", " ", "  ", "\n", "\n\n", "A:", " Paris", "123", "4", "5.6",
          "'s", "é", "日本", "語", "🙂", "<|im_start|>", "<|im_end|>", "user", "\t", "!", "?!",
          " the", "ing", "-", "--", "http://", "x", ":"]


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(st.tuples(st.lists(st.sampled_from(PIECES), min_size=1, max_size=3),
                                 st.booleans()), min_size=1, max_size=10))
def test_appended_text_tokenizes_like_the_whole_text(tok, chunks) -> None:  # noqa: ANN001
    seq, text = TokenSequence(tok), ""
    for pieces, flush in chunks:
        piece = "".join(pieces)
        seq.append_text(piece)
        text += piece
        if flush:  # tokenizing after every append or in batches must not matter
            seq.flush()
    assert seq.ids == encode(tok, text)
    seq.check_integrity()


def test_program_sends_whole_text_tokenization(tok) -> None:  # noqa: ANN001
    backend = FakeBackend(tokenizer=tok, responses={"France": " Paris", "Italy": " Rome, of course"})

    @sgl.function
    def prog(s):
        s += "Q: What is the capital of France?\nA:" + sgl.gen("a", max_tokens=8)
        s += "\nQ: And of Italy?\nA:" + sgl.gen("b", max_tokens=8)
        s += "\n\nThanks!" + sgl.gen("c", max_tokens=3)

    state = prog.run(backend=backend)
    for req in backend.requests_of("generate"):
        assert req.token_ids == encode(tok, req.text)
    assert state.token_ids() == encode(tok, state.text())


def test_generated_tokens_are_kept_even_if_not_canonical(tok) -> None:  # noqa: ANN001
    text = " Paris is nice and sunny today"
    split = encode(tok, " Par") + encode(tok, "is")
    ids = split + encode(tok, text[len(" Paris"):])
    assert ids != encode(tok, text)  # a split the tokenizer would never produce
    backend = FakeBackend(tokenizer=tok, responder=lambda r: (text, ids) if r.text.endswith(":") else "ok")

    @sgl.function
    def prog(s):
        s += "City:" + sgl.gen("city", max_tokens=20)
        s += "\nMore" + sgl.gen("more", max_tokens=2)

    state = prog.run(backend=backend)
    _, second = backend.requests_of("generate")
    prompt = encode(tok, "City:")
    # The model's own tokens stay (that is what its KV cache holds) ...
    assert second.token_ids[: len(prompt) + len(split)] == prompt + split
    # ... and the sequence still decodes to exactly the text.
    assert tok.decode(second.token_ids, skip_special_tokens=False) == second.text
    state.stream_executor.tokens.check_integrity()


def test_stop_and_eos_tokens_not_shown_are_dropped(tok) -> None:  # noqa: ANN001
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def respond(req):  # noqa: ANN001, ANN202
        if req.text.endswith("A:"):
            return " Paris\nQ: more"  # cut at the "\n" stop; the fake keeps the "\n" token
        return " done", encode(tok, " done") + [eos]  # an EOS the text does not show

    backend = FakeBackend(tokenizer=tok, responder=respond)

    @sgl.function
    def prog(s):
        s += "A:" + sgl.gen("a", stop="\n") + sgl.gen("b", max_tokens=5)
        s += "." + sgl.gen("c", max_tokens=2)

    state = prog.run(backend=backend)
    assert state["a"] == " Paris"
    for req in backend.requests_of("generate"):
        assert req.token_ids == encode(tok, req.text)
    assert eos not in state.token_ids()


def test_chat_template_from_tokenizer_matches_apply_chat_template(tok) -> None:  # noqa: ANN001
    template = chat_template_from_tokenizer(tok)
    assert template.get_prefix_and_suffix("user") == ("<|im_start|>user\n", "<|im_end|>\n")
    assert template.get_prefix_and_suffix("assistant") == ("<|im_start|>assistant\n", "<|im_end|>\n")
    assert template.default_system_prompt and "SmolLM" in template.default_system_prompt
    backend = FakeBackend(tokenizer=tok, responses={"Hi": "Hello! How can I help?"})

    @sgl.function
    def chat(s):
        s += sgl.user("Hi")
        s += sgl.assistant(sgl.gen("reply", max_tokens=30))

    state = chat.run(backend=backend)
    expected = tok.apply_chat_template(state.messages(), tokenize=False)
    assert state.text() == expected
    assert state.messages()[0]["role"] == "system"
    (req,) = backend.requests_of("generate")
    assert req.text == tok.apply_chat_template(state.messages()[:2], tokenize=False,
                                               add_generation_prompt=True)


def test_select_token_boundary(tok) -> None:  # noqa: ANN001
    backend = FakeBackend(tokenizer=tok)

    @sgl.function
    def prog(s):
        s += "Hello wor" + sgl.select("w", ["ld", "m"])

    state = prog.run(backend=backend)
    (score,) = backend.requests_of("score")
    prompt_ids = encode(tok, "Hello wor")
    assert score.score_prompts == [encode(tok, "Hello world"), encode(tok, "Hello worm")]
    common = [next(i for i, (a, b) in enumerate(zip(prompt_ids + [-1], ids)) if a != b)
              for ids in score.score_prompts]
    assert score.logprob_start_len == min(common)
    # Each choice is scored on its tokens after the common prefix with the prompt.
    meta = state.get_meta_info("w")
    for ids, start, row in zip(score.score_prompts, common, meta["input_token_logprobs"]):
        assert [t[1] for t in row] == ids[start:]
    assert state.token_ids() == encode(tok, state.text())
