"""Sampling parameters: what to generate and when to stop.

Names and defaults follow SGLang's `sampling_params` dict so that code and HTTP payloads port
unchanged. Validation happens here, in plain Python, before a request reaches the engine.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from sgl._typecheck import field_hints, mismatch
from sgl.errors import InvalidConstraintError, InvalidSamplingParamsError

__all__ = ["SamplingParams", "LogprobOptions", "GREEDY_TEMPERATURE", "MAX_LOGIT_BIAS", "suggest_name",
           "stop_regex_problem", "normalize_logit_bias"]

# Temperatures below this are greedy: dividing logits by ~1e-38 overflows float32 to inf,
# and softmax over infs picks a garbage token forever. 1e-5 already makes any realistic
# logit gap decisive, so greedy is what such a temperature means.
GREEDY_TEMPERATURE = 1e-5

# Names other APIs use for our parameters: `max_tokens` (OpenAI, vLLM) is `max_new_tokens`.
NAME_ALIASES: dict[str, str] = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "max_length": "max_new_tokens",
    "stop_sequences": "stop",
    "random_seed": "seed",
    "logprobs": "return_logprob",
    "top_logprobs": "top_logprobs_num",
    "response_format": "json_schema",
}


def suggest_name(name: str, known: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for a misspelt or foreign parameter name, else ''."""
    known = sorted(known)
    alias = NAME_ALIASES.get(name)
    close = [alias] if alias in known else difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _short(value: Any) -> str:
    """repr, cut to a readable length (a bad value may be a megabyte-long list)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token and when to stop. `temperature=0` means greedy."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k truncation
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # Stop at the first match of any of these regexes in the output text (cut like `stop`).
    stop_regex: tuple[str, ...] = ()
    # token id -> bias added to its logit before temperature and filtering (OpenAI's range).
    logit_bias: dict[int, float] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string in the output
    n: int = 1
    seed: int | None = None
    # Constraints (at most one). Front ends turn schema=/choices=/dtype= into one of these.
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    jump_forward: bool | None = None  # None: the engine's default

    def __post_init__(self) -> None:
        # Normalise list-typed inputs so the dataclass stays hashable and frozen. Only a
        # string or a list is accepted: `stop={"a": 1}` must not silently become ("a",).
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop", str, "a string or a list of strings"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(
            self.stop_token_ids, "stop_token_ids", int, "a token id or a list of token ids"))
        object.__setattr__(self, "stop_regex", _as_tuple(
            self.stop_regex, "stop_regex", str, "a regex string or a list of regex strings"))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", normalize_logit_bias(self.logit_bias))
        self._validate()
        if 0.0 < self.temperature < GREEDY_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | None) -> SamplingParams:
        """Build from an SGLang-style dict; unknown keys raise with the list of known ones."""
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        if not isinstance(params, Mapping):
            raise InvalidSamplingParamsError(
                f"sampling_params must be a dict or sgl.SamplingParams, not {type(params).__name__}",
                field="sampling_params")
        known = cls.field_names()
        unknown = sorted(set(params) - known, key=str)
        if unknown:
            raise InvalidSamplingParamsError(
                f"unknown sampling parameter(s) {unknown}{suggest_name(str(unknown[0]), known)}; "
                f"known: {sorted(known)}",
                field=str(unknown[0]),
            )
        return cls(**{k: v for k, v in params.items() if v is not None or k == "seed"})

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["stop_regex"] = list(self.stop_regex)
        return d

    # -- derived ------------------------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        # A temperature below GREEDY_TEMPERATURE was already set to 0 at construction.
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, spec) of the constraint, kind in {"regex", "json_schema", "ebnf"}, or None."""
        for kind in ("regex", "json_schema", "ebnf"):
            spec = getattr(self, kind)
            if spec is not None:
                return kind, spec
        return None

    # -- validation ---------------------------------------------------------------------------

    def _validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise InvalidSamplingParamsError(f"{name}={_short(getattr(self, name))}: {why}", field=name)

        # Types first, read from the annotations: a flag is a bool (`skip_special_tokens=0`
        # would reach the detokenizer on the engine thread), an integer is never a bool.
        hints = field_hints(SamplingParams)
        for f in dataclasses.fields(self):
            why = mismatch(getattr(self, f.name), hints[f.name])
            if why is not None:
                if f.name == "json_schema":
                    why = "must be a string (dump a JSON schema dict with json.dumps)"
                fail(f.name, why)
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                fail(name, "must be a finite number")

        if self.max_new_tokens < 0:
            fail("max_new_tokens", "must be >= 0")
        if self.min_new_tokens < 0:
            fail("min_new_tokens", "must be >= 0")
        if self.min_new_tokens > self.max_new_tokens:
            fail("min_new_tokens", f"must be <= max_new_tokens ({self.max_new_tokens})")
        if self.temperature < 0:
            fail("temperature", "must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            fail("top_k", "must be -1 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            fail("repetition_penalty", "must be in (0, 2]")
        if self.n < 1:
            fail("n", "must be >= 1")
        if any(not s for s in self.stop):
            fail("stop", "stop strings must be non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative integers")
        for i, pattern in enumerate(self.stop_regex):
            why = stop_regex_problem(pattern)
            if why is not None:
                raise InvalidSamplingParamsError(f"stop_regex[{i}]={_short(pattern)}: {why}", field="stop_regex")
        given = [k for k in ("regex", "json_schema", "ebnf") if getattr(self, k) is not None]
        if len(given) > 1:  # the same class as build_constraint's conflicts (schema= with regex=, ...)
            raise InvalidConstraintError(f"only one constraint may be given, got {given}", field=given[1])


# OpenAI's bound on a logit bias: +-100 already bans or forces a token.
MAX_LOGIT_BIAS = 100.0


def normalize_logit_bias(value: Any) -> dict[int, float]:
    """{token id: bias} with int or numeric-string keys (JSON objects have string keys, so
    OpenAI and SGLang clients send "1234") -> {int: float}; anything else raises."""
    if not isinstance(value, Mapping):
        raise InvalidSamplingParamsError(f"logit_bias={_short(value)}: must be a dict of token id -> bias",
                                         field="logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = key
        if isinstance(key, str) and key.strip().isdigit():
            token = int(key)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidSamplingParamsError(f"logit_bias key {_short(key)}: must be a token id (an integer "
                                             ">= 0)", field="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise InvalidSamplingParamsError(f"logit_bias[{token}]={_short(bias)}: must be a finite number",
                                             field="logit_bias")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidSamplingParamsError(f"logit_bias[{token}]={bias}: must be in [-100, 100]",
                                             field="logit_bias")
        out[token] = float(bias)
    return out


def stop_regex_problem(pattern: str) -> str | None:
    """Why `pattern` cannot be a stop regex, or None. The `regex` module runs it (it can tell
    a text that may still grow into a match, which streaming needs), so it judges it."""
    import regex  # imported here, when a stop regex is given, to keep `import sgl` light

    if not pattern:
        return "must be a non-empty regex"
    try:
        compiled = regex.compile(pattern)
    except (regex.error, ValueError, OverflowError, RecursionError) as exc:
        return f"is not a valid regex: {exc}"
    if compiled.search("") is not None:
        return "matches the empty text, so it would stop every generation at once"
    return None


def _as_tuple(value: Any, name: str, item: type, what: str) -> tuple[Any, ...]:
    """None, one item, or a list/tuple of items -> a tuple; anything else raises naming `name`.

    The items' own types are checked by `_validate` (from the annotation)."""
    if value is None:
        return ()
    if isinstance(value, item) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise InvalidSamplingParamsError(f"{name}={_short(value)}: must be {what}", field=name)


@dataclass(frozen=True)
class LogprobOptions:
    """Which log-probabilities to return with a request.

    `logprob_start_len` is the first prompt position whose logprob is returned
    (-1: none of the prompt; 0: all of it, the first token then has no logprob).
    """

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0

    def __post_init__(self) -> None:
        hints = field_hints(LogprobOptions)
        for f in dataclasses.fields(self):
            why = mismatch(getattr(self, f.name), hints[f.name])
            if why is not None:
                raise InvalidSamplingParamsError(f"{f.name}={_short(getattr(self, f.name))}: {why}",
                                                 field=f.name)
        if self.top_logprobs_num < 0:
            raise InvalidSamplingParamsError(
                f"top_logprobs_num={self.top_logprobs_num}: must be >= 0", field="top_logprobs_num"
            )
        if self.logprob_start_len < -1:
            raise InvalidSamplingParamsError(
                f"logprob_start_len={self.logprob_start_len}: must be >= -1",
                field="logprob_start_len",
            )

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0
