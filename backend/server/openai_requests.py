"""OpenAI request bodies -> engine jobs (validation included, every error names its field).

OpenAI names map to the engine's SGLang names: max_tokens -> max_new_tokens, min_tokens ->
min_new_tokens, logprobs/top_logprobs -> return_logprob/top_logprobs_num, response_format ->
json_schema. SGLang's extra fields (regex, ebnf, json_schema, top_k, min_p, ...) pass through,
as they do on SGLang's and vLLM's OpenAI servers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sgl.sampling import LogprobOptions

from sgl.backend.server.driver import Job
from sgl.backend.server.protocol import ApiError, Fields

__all__ = ["OpenAIRequest", "parse_completion", "parse_chat"]

# Extra sampling fields accepted on both endpoints, with the engine's name for each.
_EXTRA = {"top_k": ("top_k", int), "min_p": ("min_p", (int, float)),
          "repetition_penalty": ("repetition_penalty", (int, float)),
          "min_tokens": ("min_new_tokens", int), "ignore_eos": ("ignore_eos", bool),
          "stop_token_ids": ("stop_token_ids", list), "skip_special_tokens": ("skip_special_tokens", bool),
          "spaces_between_special_tokens": ("spaces_between_special_tokens", bool),
          "no_stop_trim": ("no_stop_trim", bool), "regex": ("regex", str), "ebnf": ("ebnf", str)}
_NUMBER = (int, float)
_IGNORED = ("model", "user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options")


@dataclass
class OpenAIRequest:
    job: Job
    chat: bool
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    top_logprobs: int = 0
    prompt_text: str = ""  # for echo


def _common(f: Fields) -> dict[str, Any]:
    """Sampling fields both endpoints share -> engine kwargs."""
    params: dict[str, Any] = {}
    for key, engine_key, types in (("temperature", "temperature", _NUMBER), ("top_p", "top_p", _NUMBER),
                                   ("n", "n", int), ("seed", "seed", int),
                                   ("presence_penalty", "presence_penalty", _NUMBER),
                                   ("frequency_penalty", "frequency_penalty", _NUMBER)):
        value = f.typed(key, types)
        if value is not None:
            params[engine_key] = value
    stop = f.raw("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ApiError(400, "stop must be a string or a list of strings", "stop")
        params["stop"] = stop
    for key, (engine_key, types) in _EXTRA.items():
        value = f.typed(key, types)
        if value is not None:
            params[engine_key] = value
    schema = _response_format(f)
    extra_schema = f.raw("json_schema")
    if extra_schema is not None:
        schema = extra_schema if isinstance(extra_schema, str) else json.dumps(extra_schema)
    if schema is not None:
        params["json_schema"] = schema
    best_of = f.typed("best_of", int)
    if best_of is not None and best_of != params.get("n", 1):
        raise ApiError(400, "best_of is not supported (only best_of == n)", "best_of")
    f.unsupported("logit_bias")
    f.ignore(*_IGNORED)
    return params


def _response_format(f: Fields) -> str | None:
    fmt = f.raw("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object",
                           "response_format.json_schema.schema")
        return json.dumps(schema)
    raise ApiError(400, "response_format.type must be 'text', 'json_object' or 'json_schema'",
                   "response_format.type")


def _stream_flags(f: Fields) -> tuple[bool, bool]:
    stream = bool(f.typed("stream", bool, False))
    opts = f.raw("stream_options")
    include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
    return stream, include_usage


def _room(engine: Any, prompt_len: int) -> int:
    """max_tokens when the client gives none: whatever the context and the KV pool leave."""
    return max(1, min(engine.context_length, engine.config.max_total_tokens) - prompt_len)


def parse_completion(body: dict[str, Any], engine: Any) -> list[OpenAIRequest]:
    f = Fields(body)
    prompt = f.raw("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and p) for p in prompt):
        prompts = list(prompt)
    else:
        raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids "
                            "or a list of such lists", "prompt")
    params = _common(f)
    params["max_new_tokens"] = f.typed("max_tokens", int, 16)  # OpenAI's default for completions
    logprobs = f.typed("logprobs", int)
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise ApiError(400, "logprobs must be between 0 and 20", "logprobs")
    echo = bool(f.typed("echo", bool, False))
    stream, include_usage = _stream_flags(f)
    f.unsupported("suffix", allowed=(None, ""))
    f.reject_unknown()
    if echo and stream and logprobs is not None:
        raise ApiError(400, "echo with logprobs is not supported when streaming", "echo")
    lp = LogprobOptions(return_logprob=logprobs is not None,
                        logprob_start_len=0 if echo and logprobs is not None else -1,
                        top_logprobs_num=logprobs or 0)
    reqs = []
    for p in prompts:
        text = "" if not echo else (p if isinstance(p, str) else engine.decode(p))
        reqs.append(OpenAIRequest(Job(p, dict(params), lp), chat=False, stream=stream,
                                  include_usage=include_usage, echo=echo, top_logprobs=logprobs or 0,
                                  prompt_text=text))
    return reqs


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"{where} must be an object with a role", where)
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"{where}.content[{j}]: only text parts are supported",
                                   f"{where}.content")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ApiError(400, f"{where}.content must be a string or a list of text parts", f"{where}.content")
        role = "system" if m["role"] == "developer" else m["role"]
        message = {"role": role, "content": content}
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
        out.append(message)
    return out


def parse_chat(body: dict[str, Any], engine: Any) -> list[OpenAIRequest]:
    f = Fields(body)
    messages = _messages(f.raw("messages"))
    params = _common(f)
    max_tokens = f.typed("max_completion_tokens", int)
    legacy = f.typed("max_tokens", int)
    max_tokens = legacy if max_tokens is None else max_tokens
    want = bool(f.typed("logprobs", bool, False))
    top = f.typed("top_logprobs", int, 0)
    if not 0 <= top <= 20:
        raise ApiError(400, "top_logprobs must be between 0 and 20", "top_logprobs")
    if top and not want:
        raise ApiError(400, "top_logprobs requires logprobs=true", "top_logprobs")
    stream, include_usage = _stream_flags(f)
    for key in ("tools", "functions"):
        f.unsupported(key, why=" (no tool calling); describe tools in the prompt and use response_format")
    f.unsupported("tool_choice", allowed=(None, "none"))
    f.unsupported("function_call", allowed=(None, "none"))
    f.reject_unknown()
    # Tokenize here (exactly as the engine would) to size max_tokens against the context.
    ids = engine.apply_chat_template(messages, tokenize=True)  # message text never becomes control tokens
    params["max_new_tokens"] = max_tokens if max_tokens is not None else _room(engine, len(ids))
    lp = LogprobOptions(return_logprob=want, top_logprobs_num=top)
    return [OpenAIRequest(Job(ids, params, lp), chat=True, stream=stream, include_usage=include_usage,
                          top_logprobs=top)]
