"""The public functions of the language, with SGLang's names, arguments and defaults."""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

from sgl.errors import BackendCapabilityError, InvalidConstraintError, InvalidRequestError
from sgl.lang import context
from sgl.lang.choices import ChoicesSamplingMethod, resolve_choices_method, token_length_normalized
from sgl.lang.function import SglFunction
from sgl.lang.ir import (GenOptions, SglExpr, SglExprList, SglGen, SglRoleBegin, SglRoleEnd,
                         SglSelect, as_expr)
from sgl.lang.loop import background_loop, run_blocking

__all__ = [
    "function", "gen", "gen_int", "gen_string", "select", "image", "video",
    "system", "user", "assistant", "system_begin", "system_end", "user_begin", "user_end",
    "assistant_begin", "assistant_end", "set_default_backend", "get_default_backend",
    "flush_cache", "get_server_info",
]

set_default_backend = context.set_default_backend
get_default_backend = context.get_default_backend


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None
             ) -> Any:
    """Decorate a program: `@sgl.function` or `@sgl.function(num_api_spec_tokens=...)`.

    The first parameter is the state `s`; the body may be `def` or `async def`.
    `num_api_spec_tokens` is accepted for compatibility (API speculative execution is for
    remote chat APIs and has no effect on an in-process engine).
    """
    if func is not None:
        return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)
    return lambda f: SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    stop_regex: str | Sequence[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: Sequence[str] | None = None,
    choices_method: ChoicesSamplingMethod | str | None = None,
    regex: str | None = None,
    json_schema: Any = None,
    *,
    schema: Any = None,
    grammar: str | None = None,
    **sampling: Any,
) -> SglExpr:
    """Generate text into variable `name`. Values left None take the run() defaults.

    sgl additions (keyword-only): `schema=` a Pydantic model or type, the variable then holds
    the validated value; `grammar=` EBNF text or a grammar name; any other SamplingParams
    field (`seed=`, `repetition_penalty=`...) by name.
    """
    if choices:
        return select(name, choices, 0.0 if temperature is None else temperature,
                      token_length_normalized if choices_method is None else choices_method)
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as exc:
            raise InvalidConstraintError(f"regex={regex!r} does not compile: {exc}", field="regex") from exc
    options = GenOptions(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop,
        stop_token_ids=stop_token_ids, stop_regex=stop_regex, temperature=temperature,
        top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty, ignore_eos=ignore_eos, return_logprob=return_logprob,
        logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, dtype=dtype, regex=regex,
        json_schema=json_schema, schema=schema, grammar=grammar, extra=dict(sampling),
    )
    return SglGen(name, options)


def gen_int(name: str | None = None, max_tokens: int | None = None, n: int | None = None,
            stop: str | Sequence[str] | None = None, **kwargs: Any) -> SglExpr:
    """gen(dtype=int): an integer, as text (SGLang semantics)."""
    return gen(name, max_tokens, None, n, stop, dtype=int, **kwargs)


def gen_string(name: str | None = None, max_tokens: int | None = None, n: int | None = None,
               stop: str | Sequence[str] | None = None, **kwargs: Any) -> SglExpr:
    """gen(dtype=str): a double-quoted string, as text (SGLang semantics)."""
    return gen(name, max_tokens, None, n, stop, dtype=str, **kwargs)


def select(name: str | None = None, choices: Sequence[str] | None = None,
           temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod | str = token_length_normalized) -> SglExpr:
    """Pick one of `choices` by scoring each as a continuation (see sgl.lang.choices)."""
    if not choices:
        raise InvalidRequestError("select() needs a non-empty list of choices", field="choices")
    if any(not isinstance(c, str) or not c for c in choices):
        raise InvalidRequestError("select() choices must be non-empty strings", field="choices")
    return SglSelect(name, choices, temperature, resolve_choices_method(choices_method))


def image(expr: Any) -> SglExpr:
    raise BackendCapabilityError("sgl.image: sgl runs text-only models; images are not supported")


def video(path: str, num_frames: int) -> SglExpr:
    raise BackendCapabilityError("sgl.video: sgl runs text-only models; videos are not supported")


def _role(role: str, expr: Any = None) -> SglExprList:
    inner = [] if expr is None else [as_expr(expr)]
    return SglExprList([SglRoleBegin(role), *inner, SglRoleEnd(role)])


def system(expr: Any = None) -> SglExprList:
    return _role("system", expr)


def user(expr: Any = None) -> SglExprList:
    return _role("user", expr)


def assistant(expr: Any = None) -> SglExprList:
    return _role("assistant", expr)


def system_begin() -> SglRoleBegin:
    return SglRoleBegin("system")


def system_end() -> SglRoleEnd:
    return SglRoleEnd("system")


def user_begin() -> SglRoleBegin:
    return SglRoleBegin("user")


def user_end() -> SglRoleEnd:
    return SglRoleEnd("user")


def assistant_begin() -> SglRoleBegin:
    return SglRoleBegin("assistant")


def assistant_end() -> SglRoleEnd:
    return SglRoleEnd("assistant")


def flush_cache(backend: Any = None) -> bool:
    """Empty the backend's prefix cache; False when there is no backend."""
    resolved = context.as_backend(backend) if backend is not None else context.get_default_backend()
    if resolved is None:
        return False
    return bool(run_blocking(resolved.flush_cache(), background_loop()))


def get_server_info(backend: Any = None) -> dict[str, Any] | None:
    resolved = context.as_backend(backend) if backend is not None else context.get_default_backend()
    return None if resolved is None else resolved.get_server_info()
