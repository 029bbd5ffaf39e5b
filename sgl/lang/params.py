"""Resolve one gen's sampling parameters: run() defaults, then the gen's own overrides.

SGLang semantics: `f.run(temperature=0.7)` sets defaults for every gen of the program; a value
given to `gen(...)` (not None) wins; the chat template's stop strings are added to every gen;
`dtype=int/float` also stops at a space or newline. `stop_regex` and `logit_bias` (given to
gen or run) reach SamplingParams unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from sgl.errors import BackendCapabilityError, InvalidConstraintError
from sgl.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, GenOptions
from sgl.sampling import LogprobOptions, SamplingParams

__all__ = ["RUN_DEFAULTS", "ResolvedGen", "resolve_gen"]

# The defaults of SGLang's SglFunction.run / run_batch.
RUN_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128,
    "stop": (),
    "stop_token_ids": (),
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "ignore_eos": False,
    "return_logprob": None,
    "logprob_start_len": None,
    "top_logprobs_num": None,
    "return_text_in_logprobs": None,
}

_LOGPROB_KEYS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")
_CONSTRAINT_KEYS = ("dtype", "regex", "json_schema", "schema", "grammar")
_DTYPE_REGEX = {int: REGEX_INT, float: REGEX_FLOAT, bool: REGEX_BOOL, str: REGEX_STR,
                "int": REGEX_INT, "float": REGEX_FLOAT, "bool": REGEX_BOOL, "str": REGEX_STR}


@dataclasses.dataclass
class ResolvedGen:
    params: SamplingParams
    logprobs: LogprobOptions
    constraint: Any = None  # sgl.constraints.ConstraintSpec when a constraint was given
    typed: bool = False  # schema= was given: the variable holds the parsed value


def _as_list(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    return list(stop)


def resolve_gen(defaults: Mapping[str, Any], options: GenOptions, stop_str: tuple[str, ...] = ()
                ) -> ResolvedGen:
    merged = dict(defaults)
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if f.name in _CONSTRAINT_KEYS or f.name == "extra" or value is None:
            continue
        merged[f.name] = value
    merged.update(options.extra)
    stop = _as_list(merged.get("stop"))
    stop += [s for s in stop_str if s not in stop]

    constraint = _build_constraint(options)
    if options.dtype in (int, float, "int", "float"):
        stop += [s for s in (" ", "\n") if s not in stop]
    merged["stop"] = stop
    if constraint is not None:
        merged.update(_sampling_kwargs(constraint))

    lp = {k: merged.pop(k, None) for k in _LOGPROB_KEYS}
    logprobs = LogprobOptions(
        return_logprob=bool(lp["return_logprob"]),
        logprob_start_len=-1 if lp["logprob_start_len"] is None else lp["logprob_start_len"],
        top_logprobs_num=lp["top_logprobs_num"] or 0,
    )
    params = SamplingParams.from_dict({k: v for k, v in merged.items() if v is not None})
    return ResolvedGen(params, logprobs, constraint, typed=options.schema is not None)


def _build_constraint(options: GenOptions) -> Any:
    given = {k: getattr(options, k) for k in _CONSTRAINT_KEYS if getattr(options, k) is not None}
    if not given:
        return None
    try:
        from sgl.constraints import build_constraint
    except ImportError:
        return _fallback_constraint(given)
    return build_constraint(**given)


class _TextConstraint:
    """Stand-in for sgl.constraints.ConstraintSpec when that module is unavailable."""

    def __init__(self, kind: str, text: str) -> None:
        self.kind, self.text = kind, text

    def sampling_kwargs(self) -> dict[str, str]:
        return {self.kind: self.text}

    def parse(self, text: str, finish_reason: str | None = None) -> str:
        return text


def _fallback_constraint(given: dict[str, Any]) -> _TextConstraint:
    import json

    if len(given) > 1:
        raise InvalidConstraintError(f"conflicting constraints {sorted(given)}; give only one")
    (name, value), = given.items()
    if name == "regex":
        return _TextConstraint("regex", value)
    if name == "json_schema":
        return _TextConstraint("json_schema", value if isinstance(value, str) else json.dumps(value))
    if name == "dtype" and value in _DTYPE_REGEX:
        return _TextConstraint("regex", _DTYPE_REGEX[value])
    raise BackendCapabilityError(f"gen({name}=...) needs the sgl.constraints module")


def _sampling_kwargs(constraint: Any) -> dict[str, str]:
    if hasattr(constraint, "sampling_kwargs"):
        return dict(constraint.sampling_kwargs())
    return {constraint.kind: getattr(constraint, "text", None) or constraint.spec}
