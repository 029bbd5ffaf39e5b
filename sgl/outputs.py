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
    "ToolCall",
    "ToolCallDelta",
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
class ToolCall:
    """One tool call the model made (see `generate(..., tools=[...])`).

    `arguments` is the parsed JSON object, grammar-guaranteed to match the tool's schema;
    `value` is the validated Pydantic instance when the tool was given as a Pydantic model
    (or as a function: its arguments model), else None. `arguments_json` is the text as
    generated, what OpenAI's `function.arguments` carries.
    """

    id: str
    name: str
    arguments: dict[str, Any]
    arguments_json: str
    value: Any = field(default=None, repr=False)
    index: int = 0  # position among the output's tool calls


@dataclass
class ToolCallDelta:
    """A streamed piece of a tool call, in OpenAI's shape: the first delta of a call carries
    `id` and `name`, later ones `arguments` fragments (their concatenation is the JSON text)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


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
    # Set when the text was split (a reasoning model, or tools=): `text` stays the whole raw
    # text; `reasoning` is what the model wrote between <think> and </think>, `content` the
    # text outside the reasoning and the tool calls, `tool_calls` the calls it made.
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] | None = None

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
    # Set when the text is split (see GenerateOutput): the pieces of `text` that are
    # reasoning, content, or tool-call deltas. Their concatenation plus the markers is `text`.
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    # With schema=<Pydantic model>: everything of the object complete so far, as an instance
    # of the model's partial type (every field optional; None while incomplete).
    partial: Any = None


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
    # n-gram speculation (speculative_algorithm="ngram"): request-steps that verified drafts,
    # drafts proposed, drafts accepted
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # -- memory, in bytes (docs/operations.md, "Reading engine.stats()") -------------------
    weights_bytes: int = 0  # model weights as held (quantized tables at their packed size)
    kv_bytes_reserved: int = 0  # KV pool capacity (CPU: address space, not memory)
    kv_bytes_touched: int = 0  # KV pool memory ever written (CPU grows on demand; GPU: all)
    kv_bytes_used: int = 0  # KV slots in use now (requests + radix cache)
    kv_bytes_per_token: int = 0  # one token's K and V in every layer (kv_cache_dtype's size)
    decode_stage_bytes: int = 0  # CPU decode stage (dense copies of running requests' KV)
    rss_bytes: int = 0  # the process's resident memory now (0 where unknown)
    peak_rss_bytes: int = 0  # ... and its peak since the process started

    @property
    def spec_acceptance_rate(self) -> float:
        """Share of proposed draft tokens that were accepted (0 when none were proposed)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_accept_length(self) -> float:
        """Tokens gained per verify step: accepted drafts plus the step's own sample."""
        return 1 + self.spec_accepted_tokens / self.spec_verify_steps if self.spec_verify_steps else 0.0
