"""The backend interface: what the interpreter needs from a model.

The interpreter owns a program's state (text, token ids, roles, variables) and calls a backend
with a `Prompt` for each model call. A backend implements:

    capabilities     tokenizer (None: text only), supports_logprobs, supports_streaming
    get_chat_template()                                 role prefix/suffix strings
    async generate(prompt, params, logprobs) -> [Completion]      one per sample (n)
    stream(prompt, params, logprobs) -> AsyncIterator[CompletionChunk]
    async score(token_id_lists, logprob_start_len) -> per-prompt token logprobs
    async select(prompt, choices, temperature, method) -> ChoicesDecision
    async cache_prefix(prompt)                          warm the prefix cache (run_batch, fork)

`select` has a default implementation on top of `score` that handles the token boundary
between prompt and choice (see `select`). Text-only backends override `select` or leave
`supports_logprobs` False, in which case select raises BackendCapabilityError.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from sgl._seq import common_prefix_len
from sgl.errors import BackendCapabilityError
from sgl.lang.chat import ChatTemplate, get_chat_template
from sgl.lang.choices import ChoicesDecision, ChoicesSamplingMethod, normalized_logprob
from sgl.lang.tokens import Tokenizer, merge_text
from sgl.sampling import LogprobOptions, SamplingParams

__all__ = ["Backend", "Prompt", "Completion", "CompletionChunk", "TokenLogprobTuple"]

# (logprob, token_id, text): SGLang's layout of one entry of input/output_token_logprobs.
TokenLogprobTuple = tuple[float, int, "str | None"]


@dataclass
class Prompt:
    """What a model call continues. `token_ids` is the exact tokenization of `text` (plus the
    tokenizer's special prefix) when the backend has a tokenizer, else None."""

    text: str
    token_ids: list[int] | None = None
    prefix_len: int = 0  # how many of token_ids are the special prefix (BOS)


@dataclass
class Completion:
    """One generated sample. `meta_info` uses SGLang's keys (prompt_tokens, finish_reason...)."""

    text: str
    token_ids: list[int] | None = None
    meta_info: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None


@dataclass
class CompletionChunk:
    text: str
    token_ids: list[int] | None = None
    completion: Completion | None = None  # set on the last chunk


class Backend(ABC):
    """Base class of every backend; subclass and implement `generate` (and `score`)."""

    tokenizer: Tokenizer | None = None
    supports_logprobs: bool = False
    supports_streaming: bool = False
    is_chat_model: bool = False  # SGLang's flag; True only for chat-only APIs

    @property
    def supports_token_ids(self) -> bool:
        return self.tokenizer is not None

    def get_chat_template(self) -> ChatTemplate:
        return get_chat_template("default")

    @abstractmethod
    async def generate(
        self, prompt: Prompt, params: SamplingParams, logprobs: LogprobOptions
    ) -> list[Completion]:
        """Generate `params.n` samples continuing `prompt`. Constraints are in `params`."""

    async def stream(
        self, prompt: Prompt, params: SamplingParams, logprobs: LogprobOptions
    ) -> AsyncIterator[CompletionChunk]:
        """Stream one sample. The default yields the whole completion as one chunk."""
        (completion,) = await self.generate(prompt, params, logprobs)
        yield CompletionChunk(completion.text, completion.token_ids, completion)

    async def score(
        self, prompts: Sequence[Sequence[int]], logprob_start_len: int
    ) -> list[list[TokenLogprobTuple]]:
        """Prompt logprobs of positions logprob_start_len.. of each token list (no generation).

        Entry i of a result is the logprob of token `logprob_start_len + i` given the tokens
        before it; position 0 has no context and is reported as nan.
        """
        raise BackendCapabilityError(
            f"{type(self).__name__} cannot score tokens, so select() is unavailable; use a "
            f"backend with logprobs (sgl.Engine) or gen(regex=...) to constrain the answer"
        )

    async def cache_prefix(self, prompt: Prompt) -> None:
        """Make `prompt` a cached prefix (no-op by default)."""

    async def select(
        self,
        prompt: Prompt,
        choices: Sequence[str],
        temperature: float,
        method: ChoicesSamplingMethod,
    ) -> ChoicesDecision:
        """Score every choice as a continuation of `prompt` and let `method` decide.

        The boundary: "Answer:" + " True" may tokenize differently from "Answer:" followed by
        the tokens of " True". Each candidate is tokenized as prompt+choice (window
        retokenization, like appended text), and the choice's tokens are those after the
        common prefix with the prompt's tokens; one batched `score` call covers all choices.
        """
        tok = self.tokenizer
        if tok is None or prompt.token_ids is None:
            raise BackendCapabilityError(
                f"{type(self).__name__} has no tokenizer, so select() cannot score choices"
            )
        base = list(prompt.token_ids)
        full = [merge_text(tok, base, prompt.text, c, start=prompt.prefix_len) for c in choices]
        starts = [common_prefix_len(base, ids) for ids in full]
        # Position 0 never has a logprob; keep the first choice token scoreable when possible.
        start = max(min(starts), 0)
        conditional = self.score(full, start)
        if method.requires_unconditional_logprobs:
            unconditional_ids = [ids[s:] for ids, s in zip(full, starts)]
            scored, uncond = await asyncio.gather(conditional, self.score(unconditional_ids, 0))
        else:
            scored, uncond = await conditional, None
        inputs = [row[s - start :] for row, s in zip(scored, starts)]
        return method(
            choices=list(choices),
            normalized_prompt_logprobs=[normalized_logprob(row) for row in inputs],
            input_token_logprobs=inputs,
            output_token_logprobs=[[] for _ in choices],
            unconditional_token_logprobs=uncond,
        )

    async def flush_cache(self) -> bool:
        return False

    def get_server_info(self) -> dict[str, Any]:
        return {"backend": type(self).__name__}

    async def aclose(self) -> None:
        """Release resources the backend owns (not the engine it wraps)."""
