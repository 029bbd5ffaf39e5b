"""What the engine returns: final outputs, stream chunks, usage and logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "FinishReason",
    "Usage",
    "TokenLogprob",
    "Logprobs",
    "GenerateOutput",
    "StreamChunk",
    "EngineStats",
]

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the radix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    text: str | None = None


@dataclass
class Logprobs:
    """Log-probabilities of a request. Entries align with tokens.

    `prompt[i]` is the logprob of prompt token `logprob_start_len + i` given what precedes it;
    the very first prompt token has no logprob and is reported with `logprob=nan`.
    `*_top[i]` lists the `top_logprobs_num` most likely tokens at that position.
    """

    output: list[TokenLogprob] = field(default_factory=list)
    output_top: list[list[TokenLogprob]] = field(default_factory=list)
    prompt: list[TokenLogprob] = field(default_factory=list)
    prompt_top: list[list[TokenLogprob]] = field(default_factory=list)


@dataclass
class GenerateOutput:
    """The result of one generation (one of the `n` samples of a prompt)."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    index: int = 0  # which of the n samples
    logprobs: Logprobs | None = None
    matched_stop: int | str | None = None  # the stop string or token id that ended it
    error: str | None = None  # why it was aborted, when finish_reason == "abort"
    request_id: str = ""
    # Set by the engine when a constraint was given; read through `parsed`.
    parsed_value: Any = field(default=None, repr=False)
    parse_error: Exception | None = field(default=None, repr=False)

    @property
    def parsed(self) -> Any:
        """The typed value for `schema=`/`dtype=`/`choices=` (a JSON value for a plain
        json_schema, the text for a regex). Raises `sgl.ParseError` naming the cause when the
        text does not validate, e.g. when max_new_tokens cut it (finish_reason "length"); the
        output itself (text, token_ids) is always there."""
        if self.parse_error is not None:
            raise self.parse_error
        return self.parsed_value

    def __str__(self) -> str:  # print(output) shows the text
        return self.text


@dataclass
class StreamChunk:
    """An increment of a streamed generation. Concatenating `text` gives the final text.

    `token_ids` are the tokens this chunk added. With jump-forward, a jump may re-tokenize the
    last few tokens at its boundary (the text does not change), so concatenated `token_ids`
    can differ from the final `output.token_ids`, which are authoritative.
    """

    text: str
    token_ids: list[int]
    index: int = 0
    finish_reason: FinishReason | None = None
    output: GenerateOutput | None = None  # the full output, on the last chunk only
    logprobs: list[TokenLogprob] | None = None  # logprobs of token_ids when asked


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine (see `Engine.stats()`)."""

    running: int
    waiting: int
    kv_used_tokens: int
    kv_total_tokens: int
    kv_cached_tokens: int
    cache_hit_rate: float  # cached prompt tokens / prompt tokens, over finished requests
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    finished_requests: int
    retractions: int
    jump_forward_tokens: int
    steps: int
    tokens_per_s: float  # output tokens per second over the last 10 s
    # -- memory, in bytes (docs/operations.md, "Reading engine.stats()") -------------------
    weights_bytes: int = 0  # model weights as held (quantized tables at their packed size)
    kv_bytes_reserved: int = 0  # KV pool capacity (CPU: address space, not memory)
    kv_bytes_touched: int = 0  # KV pool memory ever written (CPU grows on demand; GPU: all)
    kv_bytes_used: int = 0  # KV slots in use now (requests + radix cache)
    decode_stage_bytes: int = 0  # CPU decode stage (dense copies of running requests' KV)
    rss_bytes: int = 0  # the process's resident memory now (0 where unknown)
    peak_rss_bytes: int = 0  # ... and its peak since the process started
