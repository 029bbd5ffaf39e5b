"""A deterministic backend for tests and docs: no model, same semantics.

    backend = FakeBackend(responses={"capital of France": " Paris\\n"})
    sgl.set_default_backend(backend)

- Text: `responses` maps a key to the answer; the key whose last occurrence in the prompt is
  rightmost wins ("answers the latest question"). Without a match (or with no `responses`)
  the output is the counting stream " 0 1 2 3 ...", so stop strings and max_new_tokens are
  observable. A `responder(request) -> str | (str, token_ids)` callable overrides both.
- Tokens: any Hugging Face tokenizer, or the built-in `CharTokenizer` (one token per character).
- Scores (select): `scorer(context_ids, token_id) -> logprob`, by default a stable hash.
- Failures: `fail_on="text"` (or a predicate) raises `error` when a prompt matches.
- Observability: every call is recorded in `requests`; `max_in_flight` counts concurrency.
"""

from __future__ import annotations

import asyncio
import math
import zlib
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

from sgl.lang.backend import Backend, Completion, CompletionChunk, Prompt, TokenLogprobTuple
from sgl.lang.chat import ChatTemplate, chat_template_from_tokenizer, get_chat_template
from sgl.lang.tokens import Tokenizer
from sgl.sampling import LogprobOptions, SamplingParams

__all__ = ["FakeBackend", "FakeRequest", "CharTokenizer"]


class CharTokenizer:
    """One token per character (token id = code point); canonical and exact by construction."""

    bos_token = None
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True, **_: Any) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False, **_: Any) -> str:
        return "".join(chr(i) for i in ids)


@dataclass
class FakeRequest:
    kind: str  # "generate" | "stream" | "score" | "cache_prefix"
    text: str | None
    token_ids: list[int] | None
    params: SamplingParams | None = None
    logprobs: LogprobOptions | None = None
    score_prompts: list[list[int]] | None = None
    logprob_start_len: int | None = None


Responder = Callable[[FakeRequest], "str | tuple[str, list[int]]"]


def _counting_stream(length: int) -> str:
    out, i = "", 0
    while len(out) < length:
        out += f" {i}"
        i += 1
    return out


def _hash_scorer(context: Sequence[int], token: int) -> float:
    prev = context[-1] if context else -1
    return -0.05 - (zlib.crc32(f"{prev}:{token}".encode()) % 1000) / 250.0


class FakeBackend(Backend):
    supports_logprobs = True
    supports_streaming = True

    def __init__(
        self,
        *,
        tokenizer: Tokenizer | None = None,
        responses: Mapping[str, str] | None = None,
        responder: Responder | None = None,
        scorer: Callable[[Sequence[int], int], float] | None = None,
        chat_template: ChatTemplate | str | None = None,
        delay: float = 0.0,
        fail_on: str | Callable[[FakeRequest], bool] | None = None,
        error: BaseException | type[BaseException] = RuntimeError("injected failure"),
        text_only: bool = False,
    ) -> None:
        self.tokenizer = None if text_only else (tokenizer or CharTokenizer())
        self._vocab_tokenizer = tokenizer or CharTokenizer()  # for output lengths in text mode
        self.responses = dict(responses or {})
        self.responder = responder
        self.scorer = scorer or _hash_scorer
        if isinstance(chat_template, str):
            chat_template = get_chat_template(chat_template)
        elif chat_template is None:
            has_own = getattr(tokenizer, "chat_template", None) is not None
            chat_template = chat_template_from_tokenizer(tokenizer) if has_own else get_chat_template("chatml")
        self.chat_template = chat_template
        self.delay = delay
        self.fail_on = fail_on
        self.error = error
        self.requests: list[FakeRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    # -- generation -------------------------------------------------------------------------

    async def generate(self, prompt: Prompt, params: SamplingParams, logprobs: LogprobOptions
                       ) -> list[Completion]:
        req = FakeRequest("generate", prompt.text, _copy(prompt.token_ids), params, logprobs)
        async with self._call(req):
            return [self._complete(req, prompt, params, i) for i in range(params.n)]

    async def stream(self, prompt: Prompt, params: SamplingParams, logprobs: LogprobOptions
                     ) -> AsyncIterator[CompletionChunk]:
        req = FakeRequest("stream", prompt.text, _copy(prompt.token_ids), params, logprobs)
        async with self._call(req):
            final = self._complete(req, prompt, params, 0)
        ids = final.token_ids or self._vocab_tokenizer.encode(final.text, add_special_tokens=False)
        tok = self.tokenizer or self._vocab_tokenizer
        sent = 0
        for k in range(1, len(ids) + 1):  # one chunk per token, like an engine
            # Never stream past the final text (a stop string is held back, then trimmed).
            upto = min(len(tok.decode(ids[:k], skip_special_tokens=False)), len(final.text))
            if self.delay:
                await asyncio.sleep(self.delay / max(len(ids), 1))
            yield CompletionChunk(final.text[sent:upto], ids[k - 1 : k] if final.token_ids else None)
            sent = max(sent, upto)
        yield CompletionChunk(final.text[sent:], [] if final.token_ids is not None else None, final)

    def _complete(self, req: FakeRequest, prompt: Prompt, params: SamplingParams, index: int
                  ) -> Completion:
        raw = self._respond(req, params)
        text, ids = raw if isinstance(raw, tuple) else (raw, None)
        tok = self._vocab_tokenizer
        if ids is None:
            ids = tok.encode(text, add_special_tokens=False)
        matched = None
        truncated = len(ids) > params.max_new_tokens
        if truncated:
            ids = ids[: params.max_new_tokens]
            text = tok.decode(ids, skip_special_tokens=False)
        # The counting stream never ends by itself; a canned answer ends like an EOS.
        endless = self.responder is None and self._matching_key(req) is None
        finish = "length" if truncated or endless else "stop"
        # Stop strings: cut at the earliest match; the matched string is not part of the text.
        hits = [(text.find(s), s) for s in params.stop if s in text]
        if hits:
            pos, matched = min(hits)
            text, finish = text[:pos], "stop"
            # Like an engine, keep the tokens up to and including the one that completed the stop.
            keep = next(k for k in range(len(ids) + 1)
                        if len(tok.decode(ids[:k], skip_special_tokens=False)) >= pos + len(matched))
            ids = ids[:keep]
        meta = {
            "prompt_tokens": len(prompt.token_ids) if prompt.token_ids is not None else len(prompt.text),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "finish_reason": {"type": finish, "matched": matched},
            "index": index,
        }
        return Completion(text, ids if self.tokenizer is not None else None, meta, finish)

    def _respond(self, req: FakeRequest, params: SamplingParams) -> str | tuple[str, list[int]]:
        if self.responder is not None:
            return self.responder(req)
        key = self._matching_key(req)
        if key is not None:
            return self.responses[key]
        return _counting_stream(params.max_new_tokens + 8)

    def _matching_key(self, req: FakeRequest) -> str | None:
        text = req.text or ""
        best, best_pos = None, -1
        for key in self.responses:
            pos = text.rfind(key)
            if pos >= 0 and (pos + len(key), len(key)) > (best_pos, len(best or "")):
                best, best_pos = key, pos + len(key)
        return best

    # -- scoring ----------------------------------------------------------------------------

    async def score(self, prompts: Sequence[Sequence[int]], logprob_start_len: int
                    ) -> list[list[TokenLogprobTuple]]:
        req = FakeRequest("score", None, None, score_prompts=[list(p) for p in prompts],
                          logprob_start_len=logprob_start_len)
        async with self._call(req):
            tok = self.tokenizer or self._vocab_tokenizer
            return [
                [
                    (math.nan if i == 0 else self.scorer(ids[:i], ids[i]), ids[i],
                     tok.decode([ids[i]], skip_special_tokens=False))
                    for i in range(logprob_start_len, len(ids))
                ]
                for ids in prompts
            ]

    async def cache_prefix(self, prompt: Prompt) -> None:
        req = FakeRequest("cache_prefix", prompt.text, _copy(prompt.token_ids))
        async with self._call(req):
            pass

    # -- plumbing ---------------------------------------------------------------------------

    def _call(self, req: FakeRequest) -> _InFlight:
        self.requests.append(req)
        return _InFlight(self, req)

    def _check_failure(self, req: FakeRequest) -> None:
        fail = self.fail_on
        hit = (fail in (req.text or "")) if isinstance(fail, str) else (fail is not None and fail(req))
        if hit:
            err = self.error
            # A fresh exception per failure: one instance raised in many tasks mixes tracebacks.
            raise err() if isinstance(err, type) else type(err)(*err.args)

    def requests_of(self, kind: str) -> list[FakeRequest]:
        return [r for r in self.requests if r.kind == kind]


class _InFlight:
    """Counts concurrent calls, sleeps `delay`, injects failures."""

    def __init__(self, backend: FakeBackend, req: FakeRequest) -> None:
        self.backend, self.req = backend, req

    async def __aenter__(self) -> None:
        b = self.backend
        b.in_flight += 1
        b.max_in_flight = max(b.max_in_flight, b.in_flight)
        try:
            if b.delay:
                await asyncio.sleep(b.delay)
            else:
                await asyncio.sleep(0)  # a real backend always yields to the loop
            b._check_failure(self.req)
        except BaseException:
            b.in_flight -= 1
            raise

    async def __aexit__(self, *exc: Any) -> None:
        self.backend.in_flight -= 1


def _copy(ids: list[int] | None) -> list[int] | None:
    return None if ids is None else list(ids)
