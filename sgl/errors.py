"""Exceptions raised by sgl.

The hierarchy::

    SglError
    ├── InvalidRequestError (also ValueError)   bad input, raised before any work is queued
    │   ├── InvalidSamplingParamsError          a sampling parameter is out of range or unknown
    │   ├── InvalidConstraintError              a regex / JSON schema / grammar does not compile,
    │   │                                       or two constraints are given
    │   └── ContextLengthError                  prompt or max_new_tokens exceed the context window
    ├── InvalidConfigError (also ValueError)    an engine option is unknown or out of range
    ├── ModelLoadError                          a model folder or GGUF file cannot be read
    ├── EngineError                             the engine failed while serving a request
    │   └── EngineClosedError                   the engine is closed (or closing)
    ├── RequestTimeoutError (also TimeoutError) a request ran past its `timeout`
    ├── BackendCapabilityError                  a backend cannot do what a program asks
    ├── ParseError (also ValueError)            typed output (schema=...) did not validate
    └── ProgramError                            an exception raised inside an sgl program

Every message says what to fix, not only what went wrong.
"""

from __future__ import annotations

__all__ = [
    "SglError",
    "InvalidRequestError",
    "InvalidSamplingParamsError",
    "InvalidConstraintError",
    "ContextLengthError",
    "InvalidConfigError",
    "ModelLoadError",
    "EngineError",
    "EngineClosedError",
    "RequestTimeoutError",
    "BackendCapabilityError",
    "ParseError",
    "ProgramError",
]


class SglError(Exception):
    """Base class of every exception sgl raises on purpose."""


class InvalidRequestError(SglError, ValueError):
    """A request is malformed; nothing was queued. `field` names the offending argument."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter is unknown, of the wrong type, negative, NaN, otherwise out of
    range, or over one of the engine's request limits (`max_n`, ...)."""


class InvalidConstraintError(InvalidRequestError):
    """A regex, JSON schema, Pydantic model or grammar cannot be compiled, or two are given."""


class ContextLengthError(InvalidRequestError):
    """The prompt, or prompt plus max_new_tokens, does not fit the model's context window."""


class InvalidConfigError(SglError, ValueError):
    """An engine option is unknown or has an invalid value."""


class ModelLoadError(SglError):
    """The model could not be found, downloaded or read."""


class EngineError(SglError):
    """The engine failed while running a request; `__cause__` holds the original exception."""


class EngineClosedError(EngineError):
    """The engine was closed before or while the request ran."""


class RequestTimeoutError(SglError, TimeoutError):
    """The request ran longer than its `timeout` and was aborted."""


class BackendCapabilityError(SglError):
    """The selected backend lacks a capability the program needs (e.g. logprobs for select)."""


class ParseError(SglError, ValueError):
    """Generated text did not validate against the requested type or schema."""


class ProgramError(SglError):
    """An exception escaped an sgl program; `__cause__` carries the program's traceback."""
