"""Engine configuration: one frozen dataclass, validated at construction.

Option names follow SGLang's server arguments where one exists, so that
`sgl.Engine(**server_args)` and `sgl serve --flag` read the same. Values left as `None` or
`"auto"` are resolved by the backend (which knows the device and the model) into a new
`EngineConfig` via `dataclasses.replace`; the original object is never mutated.

Validation is read from the annotations: a field's type (`int | None`, `Literal[...]`, ...)
is checked before its range, so a new field is type-checked without editing a table.

The environment is read in exactly one place: `EngineConfig.from_env_defaults` (every
`SGL_*` variable that sets an engine option, see `ENV_OPTIONS`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass
from typing import Any, Literal

from sgl._typecheck import field_hints, mismatch
from sgl.errors import InvalidConfigError

__all__ = ["EngineConfig", "SchedulePolicy", "ENV_OPTIONS"]

SchedulePolicy = Literal["lpm", "fcfs"]

_DEVICES_PREFIX = ("auto", "cpu", "cuda")
# Environment variable -> engine option. Values are parsed by the option's annotation.
ENV_OPTIONS: dict[str, str] = {
    "SGL_DEVICE": "device",
    "SGL_DTYPE": "dtype",
    "SGL_DEBUG_INTEGRITY": "debug_integrity",
    "SGL_KERNELS": "kernels",
    "SGL_KV_CACHE_DTYPE": "kv_cache_dtype",
    "SGL_NUM_THREADS": "num_threads",
    "SGL_CACHE_DIR": "cache_dir",
}
# kv_cache_dtype values: SGLang's ("bf16" is its short name, "fp8_e4m3"; vLLM's "fp8" is the
# same format) plus the two float formats.
KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16", "float16", "float32", "fp8_e4m3", "fp8")
_KV_NOT_BUILT = ("fp8_e5m2", "fp4_e2m1", "int8")  # SGLang's, not built here
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class EngineConfig:
    # -- model ----------------------------------------------------------------------------
    # A local folder or .gguf file, a Hugging Face id ("org/name", or "org/name/file.gguf" for one
    # GGUF of a repo; backend/model_source.py), or None for the embedded default.
    model: str | None = None
    tokenizer: str | None = None  # defaults to the model's own; a local path or a hub id as well
    revision: str | None = None  # hub ids: branch, tag or commit (None: main)
    load_format: Literal["auto", "gguf", "safetensors", "dummy"] = "auto"  # dummy: random weights
    model_config: dict[str, Any] | None = None  # dummy weights: a config dict or preset name in `model`
    context_length: int | None = None  # None: the model's max_position_embeddings
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    random_seed: int = 0
    cache_dir: str | None = None  # dequantized GGUF weights and the default model; None: ~/.cache/sgl
    # Weight precision (kernels in sgl/backend/quant). "gguf": a GGUF file's quantized tensors
    # stay quantized (CPU: C kernels; CUDA: Triton); "fp8" (CUDA, compute capability 8.9+):
    # float weights converted at load to float8 e4m3 with per-channel scales (activations:
    # `activation_quantization` below, W8A8 at 49 rows and more by default); "none": float
    # weights in `dtype` (a GGUF is dequantized). "auto": "gguf" on the CPU when `dtype` is
    # "auto", else "none" (an explicit dtype asks for float weights; the GPU opts in).
    quantization: Literal["auto", "none", "gguf", "fp8"] = "auto"
    # CPU, GGUF-quantized weights: "int8" quantizes each projection's input per group of the
    # weight (32 values, or 16) to int8 with one float32 scale and computes the group dot
    # products in integers (faster, not exact: outputs differ slightly from the float path).
    # "none": activations stay float32. Refused where it cannot apply (GPU, float weights).
    # GPU, quantization="fp8": "fp8" quantizes each product's input per row (token) to e4m3
    # with one float32 scale where the product has 49 rows or more (prefill, large decode
    # batches; the FP8 GEMV and tiled kernels serve fewer), and multiplies on the FP8 tensor
    # cores (torch._scaled_mm): SGLang's W8A8 for `fp8`, 1.2x bf16's batch throughput where the
    # weight-only path is 0.77x (docs/benchmarks.md), not exact. Smaller products (single
    # streams, small batches) keep unquantized inputs. "none" there: FP8 weight-only at every
    # row count. "auto": "fp8" under quantization="fp8" (SGLang's contract), else "none".
    activation_quantization: Literal["auto", "none", "int8", "fp8"] = "auto"

    # -- memory ---------------------------------------------------------------------------
    max_total_tokens: int | None = None  # KV pool size in tokens; None: from mem_fraction_static
    mem_fraction_static: float | None = None  # share of free memory for weights + KV pool
    page_size: int = 1
    # The KV pool's element type (SGLang's option; its names "bf16"/"bfloat16" and "fp8_e4m3",
    # plus "float16" and "float32"). "auto": on the CPU under a float32 model the runtime's
    # CPU_AUTO_KV_CACHE_DTYPE, else the model's dtype. "fp8_e4m3" (or "fp8"): float8 e4m3 with
    # no scale (SGLang's default scale of 1), saturated at +-448: half of float16's bytes,
    # lossy (3 mantissa bits). CUDA keeps the model's dtype or this float8 (no other).
    kv_cache_dtype: str = "auto"

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

    # -- speculative decoding: n-gram drafts from the request's own tokens (SGLang's names) --
    speculative_algorithm: Literal["ngram", "NGRAM"] | None = None  # None: off
    speculative_num_draft_tokens: int = 4  # drafts verified per step
    speculative_ngram_min_match_window_size: int = 1  # shortest suffix matched
    speculative_ngram_max_match_window_size: int = 4  # longest suffix matched (tried first)
    # sgl's own: "text" (backend/spec_text.py) matches the request's text (suffixes of 3..32
    # bytes; the windows above do not apply) and drafts the text its grammar forces; "tokens":
    # SGLang's token-id lookup with the windows above. "text" needs the tokenizer's pieces to
    # spell its text (byte-level BPE does); otherwise the engine uses "tokens".
    speculative_ngram_match: Literal["text", "tokens"] = "text"
    # vLLM's name: no drafts in a step where more than this many requests decode. Such a step
    # is plain decoding again, in the overlap loop (a step with drafts runs the loop
    # synchronously, and its verify rows multiply the step's rows: on the H200's 8B shape at
    # batch 32-256 speculation ran at 0.6-0.73x, docs/structured.md). None: draft at any batch.
    speculative_disable_by_batch_size: int | None = None

    # -- execution ------------------------------------------------------------------------
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    kernels: Literal["auto", "reference", "triton"] = "auto"  # op implementations (kernels/dispatch.py)
    num_threads: int | None = None  # CPU: torch's intra-op threads; None: torch's default
    disable_cuda_graph: bool = False
    # SGLang's flag: a request's tokens and logprobs keep their bits whatever else runs with it
    # (batch size, speculation, jump-forward, chunking, prefix-cache hits). Batch-invariant
    # kernels (one reduction order per row), steps that prefill or decode but never both; at
    # some cost in speed (docs/operations.md, "Deterministic inference").
    enable_deterministic_inference: bool = False
    cuda_graph_max_bs: int | None = None

    # -- request limits: checked before a request is queued (docs/operations.md, "Limits") ---
    max_n: int = 64  # samples per request (`n`); each one is a running request
    max_top_logprobs_num: int = 20  # alternatives per position (`top_logprobs_num`)
    max_stop_strings: int = 32  # entries in `stop`; each is searched after every token
    max_stop_string_len: int = 256  # characters per stop string (held back while streaming)
    max_stop_token_ids: int = 256  # entries in `stop_token_ids`
    max_stop_regexes: int = 32  # entries in `stop_regex`; each is searched after every token
    max_stop_regex_len: int = 256  # characters per stop regex (SGLang's bound)

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

    # -- chat formats (sgl/reasoning.py, sgl/_tool_format.py) ------------------------------
    # auto: split <think>...</think> when the chat template mentions <think>
    reasoning_parser: Literal["auto", "none", "qwen3", "deepseek-r1"] = "auto"
    # auto: read from the chat template; hermes (<tool_call>) for templates without tools
    tool_call_parser: Literal["auto", "hermes", "llama3"] = "auto"

    def __post_init__(self) -> None:
        self._validate()

    # ------------------------------------------------------------------------------------

    @classmethod
    def from_kwargs(cls, model: str | None = None, **options: Any) -> EngineConfig:
        """Build from keyword options; an unknown name raises and lists the known ones."""
        known = cls.option_names()
        unknown = sorted(set(options) - known)
        if unknown:
            close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise InvalidConfigError(
                f"unknown engine option(s) {unknown}{hint}; known options: {sorted(known)}"
            )
        return cls(model=model, **options)

    @classmethod
    def option_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_env_defaults(cls) -> dict[str, Any]:
        """Options taken from the environment (`ENV_OPTIONS`). The only place sgl reads it;
        an empty variable counts as unset, a malformed one raises naming the variable."""
        env: dict[str, Any] = {}
        hints = field_hints(cls)
        for var, name in ENV_OPTIONS.items():
            raw = os.environ.get(var, "").strip()
            if raw:
                env[name] = _parse_env(var, name, raw, hints[name])
        return env

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def _validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise InvalidConfigError(f"{name}={getattr(self, name)!r}: {why}")

        # Types first (from the annotations), so that the range checks below never raise a
        # bare TypeError, and a string like "no" is never taken as a true flag.
        hints = field_hints(type(self))
        for f in dataclasses.fields(self):
            why = mismatch(getattr(self, f.name), hints[f.name])
            if why is not None:
                fail(f.name, why)

        if not self.device.startswith(_DEVICES_PREFIX):
            fail("device", "must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if self.quantization == "fp8" and self.device == "cpu":
            fail("quantization", "'fp8' needs a CUDA device (no FP8 kernel on the CPU): use "
                 "'gguf' with a GGUF file, or 'none'")
        if self.activation_quantization == "int8":
            self._validate_int8(fail)
        if self.activation_quantization == "fp8" and self.quantization != "fp8":
            fail("activation_quantization", f"'fp8' quantizes the inputs of FP8 weights, but "
                 f"quantization={self.quantization!r}: use quantization='fp8' (CUDA), or "
                 "activation_quantization='none'")
        if self.page_size < 1:
            fail("page_size", "must be >= 1")
        if self.kv_cache_dtype in _KV_NOT_BUILT:
            fail("kv_cache_dtype", f"sgl keeps no KV cache in {self.kv_cache_dtype}: use one of "
                 f"{list(KV_CACHE_DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            fail("kv_cache_dtype", f"must be one of {list(KV_CACHE_DTYPES)}")
        for name in ("max_total_tokens", "max_running_requests", "context_length",
                     "max_prefill_tokens", "cuda_graph_max_bs", "num_threads", "max_n",
                     "max_top_logprobs_num", "max_stop_strings", "max_stop_string_len",
                     "max_stop_token_ids", "max_stop_regexes", "max_stop_regex_len",
                     "speculative_disable_by_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                fail(name, "must be a positive integer" + (" or None" if _optional(self, name) else ""))
        if self.chunked_prefill_size is not None and (
            self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1
        ):
            fail("chunked_prefill_size", "must be a positive integer, -1 (off) or None (auto)")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            fail("mem_fraction_static", "must be in (0, 1)")
        if self.request_timeout is not None and not self.request_timeout > 0:
            fail("request_timeout", "must be a positive number of seconds (or None)")
        if not self.schedule_conservativeness > 0:
            fail("schedule_conservativeness", "must be > 0")
        self._validate_grammar_limits(fail)
        self._validate_speculative(fail)

    def _validate_int8(self, fail: Any) -> None:
        # (the resolved device and quantization are checked again at load: quant/policy.py)
        if self.is_cuda:
            fail("activation_quantization", "'int8' is a CPU kernel: use device='cpu', or "
                 "'none' on a GPU")
        if self.quantization in ("none", "fp8"):
            fail("activation_quantization", f"'int8' applies to GGUF-quantized weights, but "
                 f"quantization={self.quantization!r}: use quantization='gguf' (or 'auto') "
                 "with a .gguf model, or activation_quantization='none'")
        if self.dtype not in ("auto", "float32"):
            fail("activation_quantization", f"'int8' needs float32 activations (dtype="
                 f"{self.dtype!r}): use dtype='auto' or 'float32'")

    def _validate_speculative(self, fail: Any) -> None:
        for name in ("speculative_num_draft_tokens", "speculative_ngram_min_match_window_size"):
            if getattr(self, name) < 1:
                fail(name, "must be a positive integer")
        if self.speculative_ngram_max_match_window_size < self.speculative_ngram_min_match_window_size:
            fail("speculative_ngram_max_match_window_size",
                 "must be >= speculative_ngram_min_match_window_size")
        if self.speculative_num_draft_tokens > 64:
            fail("speculative_num_draft_tokens", "must be <= 64 (each draft is a verified row)")

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


def _optional(config: EngineConfig, name: str) -> bool:
    """Whether option `name` accepts None (its annotation says `| None`)."""
    return mismatch(None, field_hints(type(config))[name]) is None


def _parse_env(var: str, name: str, raw: str, hint: Any) -> Any:
    """The value of environment variable `var` as engine option `name` (typed by `hint`)."""
    where = f"(it sets the engine option {name})"
    if mismatch(True, hint) is None:  # a flag
        if raw.lower() in _TRUE + _FALSE:
            return raw.lower() in _TRUE
        raise InvalidConfigError(f"{var}={raw!r}: must be 1 or 0 {where}")
    for kind, parse in (("an integer", int), ("a number", float)):
        if mismatch(parse(1), hint) is None and mismatch("x", hint) is not None:
            try:
                return parse(raw)
            except ValueError:
                raise InvalidConfigError(f"{var}={raw!r}: must be {kind} {where}") from None
    value = raw if mismatch(raw, hint) is None else raw.lower()  # choices are lowercase
    why = mismatch(value, hint)
    if why is not None:
        raise InvalidConfigError(f"{var}={raw!r}: {why} {where}")
    return value
