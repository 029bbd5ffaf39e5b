"""Wire-level helpers shared by the OpenAI and SGLang routes: errors, JSON, SSE, field checks.

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}` (OpenAI's
shape, which SGLang also uses), with `param` naming the offending request field so a client
can point at it. Engine exceptions are mapped in `error_from_exception`: validation errors
(`InvalidRequestError.field`) become 400s before anything was queued.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable, Mapping

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sgl.errors import (
    ContextLengthError,
    EngineClosedError,
    EngineError,
    InvalidRequestError,
    RequestTimeoutError,
)

__all__ = [
    "ApiError",
    "error_from_exception",
    "json_response",
    "read_json",
    "sse",
    "SSE_DONE",
    "Fields",
    "finite",
    "TokenTexts",
]

SSE_DONE = b"data: [DONE]\n\n"


class ApiError(Exception):
    """An HTTP error with OpenAI's JSON body. `param` names the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> Response:
        return JSONResponse(self.body(), status_code=self.status)


def error_from_exception(exc: BaseException, field_prefix: str = "") -> ApiError:
    """Map an exception raised by the engine to an ApiError.

    `field_prefix` places an engine field inside the request: the native API nests sampling
    parameters under "sampling_params", so `temperature` is reported as
    `sampling_params.temperature` there.
    """
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ContextLengthError):
        return ApiError(400, str(exc), _param(exc.field, field_prefix), code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc), _param(exc.field, field_prefix))
    if isinstance(exc, RequestTimeoutError):
        return ApiError(504, str(exc), None, type="timeout_error")
    if isinstance(exc, EngineClosedError):
        return ApiError(503, str(exc), None, type="service_unavailable")
    if isinstance(exc, EngineError):
        return ApiError(500, str(exc), None, type="engine_error")
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", None, type="internal_error")


# Fields the engine names that live outside sampling_params in both protocols.
_TOP_LEVEL = {"prompt", "input_ids", "messages", "logprob_start_len", "top_logprobs_num", "timeout"}


def _param(field: str | None, prefix: str) -> str | None:
    if field is None or not prefix or field in _TOP_LEVEL:
        return field
    return f"{prefix}.{field}"


def finite(value: float | None) -> float | None:
    """JSON has no NaN: an undefined logprob (the first prompt token) is sent as null."""
    if value is None or math.isnan(value):
        return None
    return float(value)


def json_response(payload: Any, status: int = 200) -> Response:
    body = json.dumps(payload, ensure_ascii=False, allow_nan=False).encode()
    return Response(body, status_code=status, media_type="application/json")


def sse(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, allow_nan=False).encode() + b"\n\n"


async def read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


class Fields:
    """Typed access to a request body that reports the field at fault and rejects unknown ones.

    Reading a field marks it known; `reject_unknown()` then names any field nobody read, so a
    misspelt option (`max_token`) fails loudly instead of being silently ignored.
    """

    def __init__(self, body: Mapping[str, Any], where: str = "") -> None:
        self.body, self.where, self._seen = body, where, set()

    def _name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def raw(self, key: str, default: Any = None) -> Any:
        self._seen.add(key)
        value = self.body.get(key, default)
        return default if value is None else value

    def typed(self, key: str, types: type | tuple[type, ...], default: Any = None, what: str = "") -> Any:
        value = self.raw(key, default)
        if value is default:
            return value
        # bool is an int in Python, but `"max_tokens": true` is a client bug, not 1.
        bad_bool = isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,))
        if bad_bool or not isinstance(value, types):
            raise ApiError(400, f"{self._name(key)} must be {what or _type_name(types)}, "
                                f"got {json.dumps(value)[:80]}", self._name(key))
        return value

    def ignore(self, *keys: str) -> None:
        self._seen.update(keys)

    def unsupported(self, key: str, allowed: Iterable[Any] = (None,), why: str = "") -> None:
        """Accept `key` only with one of the harmless values (absent, null, empty, ...)."""
        self._seen.add(key)
        value = self.body.get(key)
        if value in list(allowed) or value in ({}, []):
            return
        raise ApiError(400, f"{self._name(key)} is not supported by this server{why}", self._name(key))

    def reject_unknown(self) -> None:
        unknown = sorted(set(self.body) - self._seen)
        if unknown:
            raise ApiError(400, f"unknown field(s) {unknown}; check the spelling or remove them",
                           self._name(unknown[0]))


def _type_name(types: type | tuple[type, ...]) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "an object"}
    seq = types if isinstance(types, tuple) else (types,)
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in seq))


class TokenTexts:
    """Token id -> the text it decodes to (' Paris', not the BPE piece 'ĠParis'), memoized."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok, self._cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id]) if self._tok is not None else ""
            if len(self._cache) < 200_000:  # bounded by the vocabulary in practice
                self._cache[token_id] = text
        return text
