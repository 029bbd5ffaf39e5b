"""sgl: an embeddable, asyncio-native LLM inference SDK.

SGLang's program language and runtime ideas (radix KV cache, continuous batching, constrained
decoding with jump-forward), running inside your Python process. `import sgl` is light: torch
and the engine load only when an `Engine` is created.
"""

from __future__ import annotations

from sgl.config import EngineConfig
from sgl.engine import Engine
from sgl.errors import (
    BackendCapabilityError,
    ContextLengthError,
    EngineClosedError,
    EngineError,
    InvalidConfigError,
    InvalidConstraintError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    ModelLoadError,
    ParseError,
    ProgramError,
    RequestTimeoutError,
    SglError,
)
from sgl.lang import *  # noqa: F403 - the program language, re-exported (see sgl.lang.__all__)
from sgl.lang import __all__ as _lang_all
from sgl.outputs import (EngineStats, GenerateOutput, Logprobs, StreamChunk, TokenLogprob, ToolCall, ToolCallDelta,
                         Usage)
from sgl.remote import OpenAI, RuntimeEndpoint
from sgl.sampling import LogprobOptions, SamplingParams
from sgl.tools import Tool

__version__ = "0.1.0"

__all__ = [
    "__version__",
    # engine
    "Engine",
    "EngineConfig",
    "SamplingParams",
    "LogprobOptions",
    "GenerateOutput",
    "StreamChunk",
    "EngineStats",
    "Usage",
    "Logprobs",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    # errors
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
    # remote backends
    "RuntimeEndpoint",
    "OpenAI",
    # the program language
    *_lang_all,
]
