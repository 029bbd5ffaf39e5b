"""Wire-level helpers shared by the OpenAI and SGLang routes: errors, the JSON body, SSE.

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}` (OpenAI's
shape, which SGLang also uses), with `param` naming the offending request field so a client
can point at it. Engine exceptions are mapped in `error_from_exception`: validation errors
(`InvalidRequestError.field`) become 400s before anything was queued.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

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


async def read_json(request: Request, max_bytes: int, max_depth: int, timeout: float) -> dict[str, Any]:
    """The request body as a JSON object, read within `timeout` seconds, at most `max_bytes`
    long (413 beyond) and nested at most `max_depth` deep. NaN and Infinity, which Python's
    parser would accept, are not JSON and are refused."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    try:
        raw = await asyncio.wait_for(_read_capped(request, max_bytes), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s "
                            "(the server option --header-timeout)", type="timeout_error") from None
    try:
        body = json.loads(raw, parse_constant=_no_constant) if raw else None
    except RecursionError:  # the C parser recurses per nesting level
        raise _too_deep(max_depth) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if _depth_exceeds(body, max_depth):
        raise _too_deep(max_depth)
    return body


async def _read_capped(request: Request, max_bytes: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:  # a body sent without (or with a false) Content-Length
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value; send a finite number")


def _depth_exceeds(root: Any, max_depth: int) -> bool:
    """Iterative, so it cannot itself overflow; scalars are skipped without a visit."""
    stack = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server's limit of {max_bytes} bytes "
                         "(the server option --max-body-bytes)", code="limit_exceeded")


def _too_deep(max_depth: int) -> ApiError:
    return ApiError(400, f"the request body nests arrays/objects deeper than this server's limit of "
                         f"{max_depth} (the server option --max-json-depth)", code="limit_exceeded")


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
