"""The typed edge: one checker per kind of field, shared by the OpenAI and SGLang protocols.

Every request field is checked here before anything reaches the engine: a boolean must be a
JSON boolean (`"skip_special_tokens": 0` is a 400, not a truthy int), an integer an integer
(not `true`, not `"3"`, not `2.0`, and within 64 bits), a number finite, a list a list of the
right things. Each failure is an `ApiError` 400 whose `param` names the field (with its index
inside a list), and each bound is a 400 that names the limit and the flag that raises it.

The kinds of the sampling fields are read from `SamplingParams`'s type hints, so a sampling
field added to the engine is accepted, and type-checked, by both protocols without an edit here.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Iterable, Literal, Mapping

from sgl.errors import InvalidRequestError
from sgl.errors import InvalidSamplingParamsError
from sgl.sampling import SamplingParams, normalize_logit_bias, stop_regex_problem

from sgl.backend.server.options import ServerOptions
from sgl.backend.server.protocol import ApiError

__all__ = ["Fields", "SAMPLING_KINDS", "check_sampling", "check_token_ids", "show", "over_limit",
           "as_bool", "as_int", "as_number", "as_str", "check_batch", "encode_text"]

_INT64 = 2**63
Kind = Literal["bool", "int", "number", "str", "str_list", "int_list", "any"]


def show(value: Any) -> str:
    """A short JSON rendering of a bad value for an error message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def bad(name: str, what: str, value: Any) -> ApiError:
    return ApiError(400, f"{name} must be {what}, got {show(value)}", name)


def over_limit(name: str, what: str, limit: int, option: str) -> ApiError:
    return ApiError(400, f"{name}: {what} exceeds this server's limit of {limit} "
                         f"(option {ServerOptions.flag(option)})", name, code="limit_exceeded")


# -- one checker per kind -----------------------------------------------------------------------


def as_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):  # 0/1/"true" are client bugs, never coerced
        raise bad(name, "true or false", value)
    return value


def as_int(value: Any, name: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, "an integer", value)
    if not -_INT64 <= value < _INT64:
        raise bad(name, "an integer that fits in 64 bits", value)
    if lo is not None and value < lo:
        raise bad(name, f"an integer >= {lo}", value)
    if hi is not None and value > hi:
        raise bad(name, f"an integer <= {hi}", value)
    return value


def as_number(value: Any, name: str) -> float | int:
    # inf cannot come from the JSON parser (NaN/Infinity are refused there) but 1e999 can.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) < float("inf"):
        raise bad(name, "a finite number", value)
    return value


def as_str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise bad(name, "a string", value)
    return value


def as_str_list(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise bad(name, "a string or a list of strings", value)
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise bad(f"{name}[{i}]", "a string", item)
    return list(value)


def as_int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list):
        raise bad(name, "a list of integers", value)
    return [as_int(item, f"{name}[{i}]") for i, item in enumerate(value)]


def check_token_ids(value: Any, name: str) -> list[int]:
    """A non-empty list of token ids (the engine checks them against the vocabulary)."""
    if not isinstance(value, list) or not value:
        raise bad(name, "a non-empty list of token ids", value)
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            raise bad(f"{name}[{i}]", "an integer token id", item)
        if not 0 <= item < _INT64:
            raise bad(f"{name}[{i}]", "a token id >= 0", item)
    return value


def encode_text(engine: Any, text: str, name: str) -> list[int]:
    """A text prompt as the token ids the engine would make of it (the engine then receives
    the ids, so nothing is tokenized twice). A text of only characters the tokenizer drops
    (e.g. "\\x04") has no tokens: the engine must never see an empty prompt (its scheduler
    crashed on one), so that is a 400 here."""
    if not text:
        raise bad(name, "a non-empty string", text)
    try:
        ids = engine.encode(text)
    except InvalidRequestError as exc:  # e.g. a model without a tokenizer
        raise ApiError(400, str(exc), name) from None
    if not ids:
        raise bad(name, "text that tokenizes to at least one token", text)
    return ids


# -- sampling fields: kinds from SamplingParams ---------------------------------------------------


def _kind(hint: Any) -> Kind:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return _kind(args[0]) if len(args) == 1 else "any"
    if typing.get_origin(hint) in (tuple, list) and args:
        return {str: "str_list", int: "int_list"}.get(args[0], "any")
    return {bool: "bool", int: "int", float: "number", str: "str"}.get(hint, "any")


SAMPLING_KINDS: dict[str, Kind] = {name: _kind(hint)
                                   for name, hint in typing.get_type_hints(SamplingParams).items()}
_CONSTRAINTS = ("regex", "json_schema", "ebnf")


def check_sampling(name: str, value: Any, param: str, options: ServerOptions) -> Any:
    """One sampling field (engine name `name`, reported as `param`), typed and bounded."""
    if name == "json_schema" and isinstance(value, (dict, list, bool)):
        value = json.dumps(value)  # SGLang clients send the schema itself or its text
    kind = SAMPLING_KINDS.get(name, "any")
    checked: Any = {"bool": as_bool, "int": as_int, "number": as_number, "str": as_str,
                    "str_list": as_str_list, "int_list": as_int_list}.get(kind, lambda v, _: v)(value, param)
    if name == "n":
        as_int(checked, param, lo=1)
        if checked > options.max_n:
            raise over_limit(param, f"n={checked}", options.max_n, "max_n")
    elif name == "stop":
        if len(checked) > options.max_stop_strings:
            raise over_limit(param, f"{len(checked)} stop strings", options.max_stop_strings, "max_stop_strings")
        for i, s in enumerate(checked):
            if len(s) > options.max_stop_string_len:
                raise over_limit(f"{param}[{i}]", f"a stop string of {len(s)} characters",
                                 options.max_stop_string_len, "max_stop_string_len")
    elif name == "stop_regex":
        _check_stop_regex(checked, param, options)
    elif name == "logit_bias":
        try:  # JSON keys are strings: "1234" -> 1234; the engine checks them against the vocabulary
            checked = normalize_logit_bias(checked)
        except InvalidSamplingParamsError as exc:
            raise ApiError(400, str(exc), param) from None
    elif name == "stop_token_ids" and len(checked) > options.max_stop_token_ids:
        raise over_limit(param, f"{len(checked)} stop token ids", options.max_stop_token_ids,
                         "max_stop_token_ids")
    elif name in _CONSTRAINTS and len(checked.encode()) > options.max_grammar_bytes:
        raise over_limit(param, f"a {name} of {len(checked.encode())} bytes", options.max_grammar_bytes,
                         "max_grammar_bytes")
    return checked


def _check_stop_regex(patterns: list[str], param: str, options: ServerOptions) -> None:
    """Bounded (each pattern is searched after every token) and compiled here, so an invalid
    regex is a 400 before anything is queued."""
    if len(patterns) > options.max_stop_regexes:
        raise over_limit(param, f"{len(patterns)} stop regexes", options.max_stop_regexes, "max_stop_regexes")
    for i, pattern in enumerate(patterns):
        if len(pattern) > options.max_stop_regex_len:
            raise over_limit(f"{param}[{i}]", f"a stop regex of {len(pattern)} characters",
                             options.max_stop_regex_len, "max_stop_regex_len")
        why = stop_regex_problem(pattern)
        if why is not None:
            raise ApiError(400, f"{param}[{i}] {why}", f"{param}[{i}]")


# -- a request body ------------------------------------------------------------------------------


class Fields:
    """Typed access to a request object that reports the field at fault and rejects unknown ones.

    Reading a field marks it known; `reject_unknown()` then names any field nobody read, so a
    misspelt option (`max_token`) fails loudly instead of being silently ignored. A JSON null
    reads as absent (clients send nulls for "default").
    """

    def __init__(self, body: Mapping[str, Any], where: str = "",
                 options: ServerOptions | None = None) -> None:
        self.body, self.where, self._seen = body, where, set()
        self.options = options or ServerOptions()

    def name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def raw(self, key: str, default: Any = None) -> Any:
        self._seen.add(key)
        value = self.body.get(key)
        return default if value is None else value

    def boolean(self, key: str, default: bool = False) -> bool:
        value = self.raw(key)
        return default if value is None else as_bool(value, self.name(key))

    def integer(self, key: str, default: int | None = None, lo: int | None = None,
                hi: int | None = None) -> int | None:
        value = self.raw(key)
        return default if value is None else as_int(value, self.name(key), lo, hi)

    def number(self, key: str, default: float | None = None) -> float | None:
        value = self.raw(key)
        return default if value is None else as_number(value, self.name(key))

    def string(self, key: str, default: str | None = None) -> str | None:
        value = self.raw(key)
        return default if value is None else as_str(value, self.name(key))

    def obj(self, key: str) -> dict[str, Any] | None:
        value = self.raw(key)
        if value is not None and not isinstance(value, dict):
            raise bad(self.name(key), "an object", value)
        return value

    def sampling(self, key: str, engine_name: str | None = None) -> Any:
        """A sampling field read under the protocol's name `key` (engine name: `engine_name`)."""
        value = self.raw(key)
        return None if value is None else check_sampling(engine_name or key, value, self.name(key),
                                                         self.options)

    def top_logprobs(self, key: str) -> int:
        value = self.integer(key, 0, lo=0)
        if value > self.options.max_top_logprobs_num:
            raise over_limit(self.name(key), f"{value} top logprobs", self.options.max_top_logprobs_num,
                             "max_top_logprobs_num")
        return value

    def ignore(self, *keys: str) -> None:
        self._seen.update(keys)

    def unsupported(self, key: str, allowed: Iterable[Any] = (None,), why: str = "") -> None:
        """Accept `key` only with one of the harmless values (absent, null, empty, ...)."""
        self._seen.add(key)
        value = self.body.get(key)
        # Compared with their types: `0` must not pass as `False`, nor `1.0` as an allowed `1`.
        if any(value is a or (type(value) is type(a) and value == a) for a in allowed) or value in ({}, []):
            return
        raise ApiError(400, f"{self.name(key)} is not supported by this server{why}", self.name(key))

    def reject_unknown(self) -> None:
        unknown = sorted(set(self.body) - self._seen)
        if unknown:
            raise ApiError(400, f"unknown field(s) {unknown}; check the spelling or remove them",
                           self.name(unknown[0]))


def check_batch(outputs: int, options: ServerOptions, param: str) -> None:
    if outputs > options.max_batch:
        raise over_limit(param, f"{outputs} outputs (prompts x n)", options.max_batch, "max_batch")
