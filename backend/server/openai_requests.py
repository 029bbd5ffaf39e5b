"""OpenAI request bodies -> engine jobs (validation included, every error names its field).

OpenAI names map to the engine's SGLang names: max_tokens -> max_new_tokens, min_tokens ->
min_new_tokens, logprobs/top_logprobs -> return_logprob/top_logprobs_num, response_format ->
json_schema. Every other engine sampling field (regex, ebnf, json_schema, top_k, min_p,
stop_token_ids, stop_regex, jump_forward, ...) is accepted under its SGLang name, as on SGLang's
and vLLM's OpenAI servers; the list is read from `SamplingParams`, so new engine fields pass
through too. `logit_bias` is OpenAI's and SGLang's: string token ids as keys, biases in [-100, 100].
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sgl.sampling import LogprobOptions

from sgl.backend.server.driver import Job
from sgl.backend.server.options import ServerOptions
from sgl.backend.server.protocol import ApiError
from sgl.backend.server.validate import (SAMPLING_KINDS, Fields, as_bool, as_str, bad, check_batch,
                                         check_sampling, check_token_ids, encode_text)

__all__ = ["OpenAIRequest", "parse_completion", "parse_chat", "ROLES"]

# OpenAI name -> engine name for the fields whose names differ or that OpenAI defines.
_MAPPED = {"temperature": "temperature", "top_p": "top_p", "n": "n", "seed": "seed",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
           "stop": "stop", "min_tokens": "min_new_tokens"}
# Engine fields reached through another OpenAI field (max_tokens, response_format).
_NOT_EXTRA = {"max_new_tokens", "min_new_tokens", "json_schema", *_MAPPED.values()}
_EXTRA = sorted(set(SAMPLING_KINDS) - _NOT_EXTRA)
_IGNORED = ("model", "user", "metadata", "store", "service_tier")
# The roles the chat templates render; "developer" is OpenAI's newer name for "system".
ROLES = ("system", "user", "assistant", "tool", "developer")
# Message keys the OpenAI client echoes back from earlier answers; harmless when null or empty.
_NULL_MESSAGE_KEYS = ("function_call", "refusal", "audio", "annotations")
# Echoed back too, and read: an assistant's earlier reasoning is not shown to the model again.
_DROPPED_MESSAGE_KEYS = ("reasoning_content",)


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
    for key, engine_key in _MAPPED.items():
        value = f.sampling(key, engine_key)
        if value is not None:
            params[engine_key] = value
    for key in _EXTRA:
        value = f.sampling(key)
        if value is not None:
            params[key] = value
    schema = _response_format(f)
    extra_schema = f.sampling("json_schema")
    if extra_schema is not None:
        schema = extra_schema
    if schema is not None:
        params["json_schema"] = schema
    best_of = f.integer("best_of")
    if best_of is not None and best_of != params.get("n", 1):
        raise ApiError(400, "best_of is not supported (only best_of == n)", "best_of")
    f.ignore(*_IGNORED)
    f.obj("custom_params")  # SGLang's extra: for custom logit processors, which sgl has none of
    return params


def _response_format(f: Fields) -> str | None:
    fmt = f.obj("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type")
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
        return check_sampling("json_schema", schema, "response_format.json_schema.schema", f.options)
    raise ApiError(400, "response_format.type must be 'text', 'json_object' or 'json_schema'",
                   "response_format.type")


def _stream_flags(f: Fields) -> tuple[bool, bool]:
    stream = f.boolean("stream")
    opts = f.obj("stream_options") or {}
    usage = opts.get("include_usage")
    return stream, usage is not None and as_bool(usage, "stream_options.include_usage")


def _room(engine: Any, prompt_len: int) -> int:
    """max_tokens when the client gives none: whatever the context and the KV pool leave."""
    return max(1, min(engine.context_length, engine.config.max_total_tokens) - prompt_len)


def _prompts(prompt: Any) -> list[Any]:
    """OpenAI's four prompt shapes: a string, token ids, a list of strings, a list of id lists.
    The first element decides which list shape is meant; the error names the element at fault."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad("prompt", "a string, a list of strings, a list of token ids or a list of such lists",
                  prompt)
    first = prompt[0]
    if isinstance(first, int) and not isinstance(first, bool):
        return [check_token_ids(prompt, "prompt")]
    if isinstance(first, str):
        return [as_str(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    if isinstance(first, list):
        return [check_token_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    raise bad("prompt[0]", "a string, a token id or a list of token ids", first)


def _echo_text(engine: Any, prompt: str | list[int], param: str) -> str:
    if isinstance(prompt, str):
        return prompt
    vocab = engine.model_config.vocab_size  # decoding an id outside it would raise in the tokenizer
    for j, t in enumerate(prompt):
        if t >= vocab:
            raise bad(f"{param}[{j}]", f"a token id below the vocabulary size {vocab}", t)
    return engine.decode(prompt)


def parse_completion(body: dict[str, Any], engine: Any, options: ServerOptions) -> list[OpenAIRequest]:
    f = Fields(body, options=options)
    prompts = _prompts(f.raw("prompt"))
    params = _common(f)
    check_batch(len(prompts) * params.get("n", 1), options, "n" if len(prompts) == 1 else "prompt")
    params["max_new_tokens"] = f.sampling("max_tokens", "max_new_tokens")
    if params["max_new_tokens"] is None:
        params["max_new_tokens"] = 16  # OpenAI's default for completions
    logprobs = f.top_logprobs("logprobs") if f.raw("logprobs") is not None else None
    echo = f.boolean("echo")
    stream, include_usage = _stream_flags(f)
    f.unsupported("suffix", allowed=(None, ""))
    f.reject_unknown()
    if echo and stream and logprobs is not None:
        raise ApiError(400, "echo with logprobs is not supported when streaming", "echo")
    lp = LogprobOptions(return_logprob=logprobs is not None,
                        logprob_start_len=0 if echo and logprobs is not None else -1,
                        top_logprobs_num=logprobs or 0)
    # Texts are tokenized here, last (the engine then gets the ids: nothing is tokenized twice).
    raw = body["prompt"]
    flat = isinstance(raw, str) or not isinstance(raw[0], (str, list))  # one text or one id list
    reqs = []
    for i, p in enumerate(prompts):
        param = "prompt" if flat else f"prompt[{i}]"
        ids = encode_text(engine, p, param) if isinstance(p, str) else p
        reqs.append(OpenAIRequest(Job(ids, dict(params), lp), chat=False, stream=stream, include_usage=include_usage,
                                  echo=echo, top_logprobs=logprobs or 0,
                                  prompt_text=_echo_text(engine, p, param) if echo else ""))
    return reqs


def _content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content", "a string or a list of text parts", content)
    texts = []
    for j, part in enumerate(content):  # content parts: text only
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": "
                                f"...}}) are supported, got {json.dumps(part)[:60]}", f"{where}.content[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise bad(where, "an object with a role and a content", m)
    role = m.get("role")
    if role not in ROLES:
        raise ApiError(400, f"{where}.role must be one of {list(ROLES)}, got {json.dumps(role)[:40]}",
                       f"{where}.role")
    for key, value in m.items():
        if key in _NULL_MESSAGE_KEYS and value not in (None, [], ""):
            raise ApiError(400, f"{where}.{key} is not supported by this server (use tool_calls)",
                           f"{where}.{key}")
        if key not in ("role", "content", "name", "tool_call_id", "tool_calls", *_NULL_MESSAGE_KEYS,
                       *_DROPPED_MESSAGE_KEYS):
            raise ApiError(400, f"{where} has an unknown field {key!r}", f"{where}.{key}")
    message = {"role": "system" if role == "developer" else role, "content": _content(m.get("content"), where)}
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            message[key] = as_str(m[key], f"{where}.{key}")
    if m.get("tool_calls") not in (None, []):
        if role != "assistant":
            raise ApiError(400, f"{where}.tool_calls is only allowed on assistant messages", f"{where}.tool_calls")
        message["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
    return message


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's earlier calls, for the chat template: arguments as a dict (what the
    templates render), read from OpenAI's JSON text."""
    if not isinstance(calls, list):
        raise bad(where, "a list of tool calls", calls)
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{where}[{i}]", '{"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}',
                      call)
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except ValueError:
                raise ApiError(400, f"{where}[{i}].function.arguments is not valid JSON",
                               f"{where}[{i}].function.arguments") from None
        if not isinstance(args, dict):
            raise bad(f"{where}[{i}].function.arguments", "a JSON object", args)
        out.append({"id": str(call.get("id") or ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _agent_fields(f: Fields) -> dict[str, Any]:
    """Tools and reasoning fields -> engine kwargs (validated by the engine, which names the
    field at fault). `functions`/`function_call` are OpenAI's deprecated names."""
    out: dict[str, Any] = {}
    for key in ("tools", "tool_choice", "parallel_tool_calls", "separate_reasoning", "max_reasoning_tokens",
                "chat_template_kwargs"):
        value = f.raw(key)
        if value is not None:
            out[key] = value
    for key in ("functions", "function_call"):
        f.unsupported(key, allowed=(None, "none", "auto"), why=" (deprecated by OpenAI): use tools and tool_choice")
    if out.get("tool_choice") == "none" and "tools" not in out:
        out.pop("tool_choice")
    # The engine gets the rendered chat prompt as token ids; saying so explicitly lets it read a
    # reasoning model's output as chat (a Qwen3 answer opens <think> itself).
    out.setdefault("separate_reasoning", True)
    return out


def _template_kwargs(agent: dict[str, Any]) -> dict[str, Any]:
    kwargs = agent.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or "tools" in kwargs:
        raise ApiError(400, "chat_template_kwargs must be an object of template variables (tools go in "
                            "'tools')", "chat_template_kwargs")
    return kwargs


def parse_chat(body: dict[str, Any], engine: Any, options: ServerOptions) -> list[OpenAIRequest]:
    f = Fields(body, options=options)
    raw = f.raw("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages", "a non-empty list of messages", raw)
    messages = [_message(m, f"messages[{i}]") for i, m in enumerate(raw)]
    params = _common(f)
    check_batch(params.get("n", 1), options, "n")
    max_tokens = f.sampling("max_completion_tokens", "max_new_tokens")
    legacy = f.sampling("max_tokens", "max_new_tokens")
    max_tokens = legacy if max_tokens is None else max_tokens
    want = f.boolean("logprobs")
    top = f.top_logprobs("top_logprobs")
    if top and not want:
        raise ApiError(400, "top_logprobs requires logprobs=true", "top_logprobs")
    stream, include_usage = _stream_flags(f)
    agent = _agent_fields(f)
    params.update(agent)
    f.reject_unknown()
    # Tokenize here (exactly as the engine would) to size max_tokens against the context.
    # Message text never becomes control tokens; the engine checks the tools (a 400 names them).
    ids = engine.apply_chat_template(messages, tokenize=True, tools=agent.get("tools"),
                                     **_template_kwargs(agent))
    params["max_new_tokens"] = max_tokens if max_tokens is not None else _room(engine, len(ids))
    lp = LogprobOptions(return_logprob=want, top_logprobs_num=top)
    return [OpenAIRequest(Job(ids, params, lp), chat=True, stream=stream, include_usage=include_usage,
                          top_logprobs=top)]
