"""Engine configuration: one frozen dataclass, validated at construction.

Option names follow SGLang's server arguments where one exists, so that
`sgl.Engine(**server_args)` and `sgl serve --flag` read the same. Values left as `None` or
`"auto"` are resolved by the backend (which knows the device and the model) into a new
`EngineConfig` via `dataclasses.replace`; the original object is never mutated.

The environment is read in exactly one place: `EngineConfig.from_env_defaults`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Literal

from sgl.errors import InvalidConfigError

__all__ = ["EngineConfig", "SchedulePolicy"]

SchedulePolicy = Literal["lpm", "fcfs"]

_DTYPES = ("auto", "float32", "bfloat16", "float16")
# The type each option must have (checked before its range); _OPTIONAL ones may be None.
_KINDS: dict[str, type] = {
    "load_format": str, "context_length": int, "device": str,
    "dtype": str, "random_seed": int, "max_total_tokens": int, "mem_fraction_static": float,
    "page_size": int, "chunked_prefill_size": int, "max_prefill_tokens": int,
    "max_running_requests": int, "schedule_policy": str, "disable_radix_cache": bool,
    "disable_overlap_schedule": bool, "disable_jump_forward": bool,
    "schedule_conservativeness": float, "attention_backend": str, "disable_cuda_graph": bool,
    "cuda_graph_max_bs": int, "request_timeout": float, "debug_integrity": bool, "log_level": str,
    # grammar limits
    "max_grammar_bytes": int, "max_json_schema_depth": int, "grammar_compile_timeout": float,
    "grammar_cache_bytes": int, "max_jump_forward_tokens": int,
}
_OPTIONAL = frozenset({"disable_overlap_schedule", "context_length", "max_total_tokens", "mem_fraction_static",
                       "chunked_prefill_size", "max_prefill_tokens", "max_running_requests",
                       "cuda_graph_max_bs", "request_timeout"})
_DEVICES_PREFIX = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class EngineConfig:
    # -- model ----------------------------------------------------------------------------
    model: str | None = None  # HF folder, .gguf file, or None for the embedded default
    tokenizer: str | None = None  # defaults to the model's own
    load_format: Literal["auto", "gguf", "safetensors", "dummy"] = "auto"  # dummy: random weights
    model_config: dict[str, Any] | None = None  # dummy weights: a config dict or preset name in `model`
    context_length: int | None = None  # None: the model's max_position_embeddings
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    random_seed: int = 0

    # -- memory ---------------------------------------------------------------------------
    max_total_tokens: int | None = None  # KV pool size in tokens; None: from mem_fraction_static
    mem_fraction_static: float | None = None  # share of free memory for weights + KV pool
    page_size: int = 1

    # -- scheduling -----------------------------------------------------------------------
    chunked_prefill_size: int | None = None  # per-step prompt-token budget; -1 disables chunking
    max_prefill_tokens: int | None = None  # tokens admitted per step (>= chunked_prefill_size)
    max_running_requests: int | None = None
    schedule_policy: SchedulePolicy = "lpm"
    disable_radix_cache: bool = False
    # None: the overlap loop on CUDA, the plain loop on the CPU, where the model step and the
    # scheduler compete for the same cores: overlap measured equal when quiet, slower under load
    # (docs/benchmarks.md).
    disable_overlap_schedule: bool | None = None
    disable_jump_forward: bool = False
    schedule_conservativeness: float = 1.0  # reserve factor for future decode tokens

    # -- GPU execution --------------------------------------------------------------------
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None

    # -- operations -----------------------------------------------------------------------
    request_timeout: float | None = None  # seconds; per-request `timeout` overrides
    debug_integrity: bool = False  # run check_integrity() on pool and tree whenever idle
    log_level: str = "warning"

    # -- grammar limits (a constraint can cost far more than its text: docs/operations.md) --
    max_grammar_bytes: int = 64 * 1024  # regex / JSON schema / EBNF source, UTF-8 bytes
    max_json_schema_depth: int = 64  # nesting of objects and arrays in a JSON schema document
    grammar_compile_timeout: float = 10.0  # seconds a request waits for its grammar to compile
    grammar_cache_bytes: int = 256 << 20  # compiled grammars kept for reuse, in bytes
    max_jump_forward_tokens: int = 64  # tokens one jump-forward may append

    def __post_init__(self) -> None:
        self._validate()

    # ------------------------------------------------------------------------------------

    @classmethod
    def from_kwargs(cls, model: str | None = None, **options: Any) -> EngineConfig:
        """Build from keyword options; an unknown name raises and lists the known ones."""
        known = cls.option_names()
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidConfigError(
                f"unknown engine option(s) {unknown}; known options: {sorted(known)}"
            )
        return cls(model=model, **options)

    @classmethod
    def option_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    @staticmethod
    def from_env_defaults() -> dict[str, Any]:
        """Options taken from the environment (SGL_DEVICE, SGL_DTYPE). The only env read."""
        env: dict[str, Any] = {}
        if os.environ.get("SGL_DEVICE"):
            env["device"] = os.environ["SGL_DEVICE"]
        if os.environ.get("SGL_DTYPE"):
            env["dtype"] = os.environ["SGL_DTYPE"]
        if os.environ.get("SGL_DEBUG_INTEGRITY") == "1":
            env["debug_integrity"] = True
        return env

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def _validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise InvalidConfigError(f"{name}={getattr(self, name)!r}: {why}")

        # Types first, so that the range checks below never raise a bare TypeError, and a
        # string like "no" is never taken as a true flag.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = _KINDS.get(f.name)
            if kind is None or (value is None and f.name in _OPTIONAL):
                continue
            if kind is bool and not isinstance(value, bool):
                fail(f.name, "must be True or False")
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                fail(f.name, "must be an integer")
            if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
                fail(f.name, "must be a number")
            if kind is str and not isinstance(value, str):
                fail(f.name, "must be a string")

        if self.dtype not in _DTYPES:
            fail("dtype", f"must be one of {_DTYPES}")
        if not self.device.startswith(_DEVICES_PREFIX):
            fail("device", "must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if self.load_format not in ("auto", "gguf", "safetensors", "dummy"):
            fail("load_format", "must be 'auto', 'gguf', 'safetensors' or 'dummy'")
        if self.page_size < 1:
            fail("page_size", "must be >= 1")
        for name in ("max_total_tokens", "max_running_requests", "context_length",
                     "max_prefill_tokens", "cuda_graph_max_bs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                fail(name, "must be a positive integer or None")
        if self.chunked_prefill_size is not None and (
            self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1
        ):
            fail("chunked_prefill_size", "must be a positive integer, -1 (off) or None (auto)")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            fail("mem_fraction_static", "must be in (0, 1)")
        if self.schedule_policy not in ("lpm", "fcfs"):
            fail("schedule_policy", "must be 'lpm' or 'fcfs'")
        if self.attention_backend not in ("auto", "torch", "triton"):
            fail("attention_backend", "must be 'auto', 'torch' or 'triton'")
        if self.request_timeout is not None and not self.request_timeout > 0:
            fail("request_timeout", "must be a positive number of seconds (or None)")
        if not self.schedule_conservativeness > 0:
            fail("schedule_conservativeness", "must be > 0")
        self._validate_grammar_limits(fail)

    def _validate_grammar_limits(self, fail: Any) -> None:
        for name in ("max_grammar_bytes", "grammar_cache_bytes", "max_jump_forward_tokens"):
            if getattr(self, name) < 1:
                fail(name, "must be a positive integer")
        # The schema front end walks documents recursively; past ~500 levels Python's own
        # recursion limit would fail first, with a worse message.
        if not 1 <= self.max_json_schema_depth <= 512:
            fail("max_json_schema_depth", "must be between 1 and 512")
        if not self.grammar_compile_timeout > 0:
            fail("grammar_compile_timeout", "must be a positive number of seconds")
