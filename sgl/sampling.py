"""Sampling parameters: what to generate and when to stop.

Names and defaults follow SGLang's `sampling_params` dict so that code and HTTP payloads port
unchanged. Validation happens here, in plain Python, before a request reaches the engine.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from sgl.errors import InvalidSamplingParamsError

__all__ = ["SamplingParams", "LogprobOptions"]


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
        # Normalise list-typed inputs so the dataclass stays hashable and frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", ())
        elif isinstance(self.stop_token_ids, int):
            object.__setattr__(self, "stop_token_ids", (self.stop_token_ids,))
        else:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | None) -> SamplingParams:
        """Build from an SGLang-style dict; unknown keys raise with the list of known ones."""
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise InvalidSamplingParamsError(
                f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}",
                field=unknown[0],
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
        return d

    # -- derived ------------------------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
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
            raise InvalidSamplingParamsError(
                f"{name}={getattr(self, name)!r}: {why}", field=name
            )

        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                fail(name, "must be a number")
            if math.isnan(value) or math.isinf(value):
                fail(name, "must be a finite number")
            return float(value)

        def integer(name: str) -> int:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                fail(name, "must be an integer")
            return value

        if integer("max_new_tokens") < 0:
            fail("max_new_tokens", "must be >= 0")
        if integer("min_new_tokens") < 0:
            fail("min_new_tokens", "must be >= 0")
        if self.min_new_tokens > self.max_new_tokens:
            fail("min_new_tokens", f"must be <= max_new_tokens ({self.max_new_tokens})")
        if number("temperature") < 0:
            fail("temperature", "must be >= 0 (0 means greedy)")
        top_p = number("top_p")
        if not 0.0 < top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if integer("top_k") < -1:
            fail("top_k", "must be -1 (disabled) or >= 1")
        if not 0.0 <= number("min_p") <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if not -2.0 <= number("frequency_penalty") <= 2.0:
            fail("frequency_penalty", "must be in [-2, 2]")
        if not -2.0 <= number("presence_penalty") <= 2.0:
            fail("presence_penalty", "must be in [-2, 2]")
        if not 0.0 < number("repetition_penalty") <= 2.0:
            fail("repetition_penalty", "must be in (0, 2]")
        if integer("n") < 1:
            fail("n", "must be >= 1")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            fail("seed", "must be an integer or None")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                fail("stop", "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                fail("stop_token_ids", "must be non-negative integers")
        given = [k for k in ("regex", "json_schema", "ebnf") if getattr(self, k) is not None]
        if len(given) > 1:
            fail(given[1], f"only one constraint may be given, got {given}")
        for k in given:
            if not isinstance(getattr(self, k), str):
                fail(k, "must be a string (dump a JSON schema dict with json.dumps)")


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
