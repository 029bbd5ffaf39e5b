"""OpenAI: programs on any OpenAI-compatible server (OpenAI, vLLM, SGLang, `sgl serve`).

    sgl.set_default_backend(sgl.OpenAI("gpt-4o-mini"))
    sgl.set_default_backend(sgl.OpenAI("Qwen/Qwen2.5-7B-Instruct", base_url="http://vllm:8000/v1"))

Chat models (the default) see a program as chat messages: roles render with ChatML markers,
and each gen, which must open an assistant turn, parses the text back into messages for
/v1/chat/completions. Completion models (`is_chat_model=False`, or a name such as
"gpt-3.5-turbo-instruct") get the text verbatim via /v1/completions.

What the protocol cannot express raises BackendCapabilityError naming it: `select` needs prompt
logprobs, which only completion endpoints return (echo + logprobs); prompt logprobs on chat
models; a gen outside an assistant turn or continuing a partial assistant message on chat
models. Constraints travel as `response_format` (json_schema) or as the `regex`/`ebnf` extra
fields understood by sgl and SGLang servers.
"""

from __future__ import annotations

import json
import re
from typing import Any, AsyncIterator, Sequence

from sgl.errors import BackendCapabilityError, EngineError, InvalidConfigError, RequestTimeoutError
from sgl.lang.backend import Backend, Completion, CompletionChunk, Prompt, TokenLogprobTuple
from sgl.lang.chat import ChatTemplate, get_chat_template
from sgl.lang.choices import ChoicesDecision, ChoicesSamplingMethod
from sgl.remote.http import PerLoop, remote_error
from sgl.remote.select import select_by_text
from sgl.sampling import LogprobOptions, SamplingParams

__all__ = ["OpenAI"]

_CHATML = get_chat_template("chatml")
_TURN = re.compile(r"<\|im_start\|>(system|user|assistant)\n(.*?)<\|im_end\|>\n", re.S)
_OPEN_ASSISTANT = "<|im_start|>assistant\n"


def messages_from_text(text: str) -> list[dict[str, str]]:
    """ChatML text ending with an open assistant turn -> chat messages."""
    messages, pos = [], 0
    for m in _TURN.finditer(text):
        if text[pos:m.start()].strip():
            raise BackendCapabilityError(
                f"chat models take messages only: text outside a role ({text[pos:m.start()][:40]!r}); "
                "wrap it in sgl.system/user/assistant or use is_chat_model=False")
        messages.append({"role": m[1], "content": m[2]})
        pos = m.end()
    rest = text[pos:]
    if not rest.startswith(_OPEN_ASSISTANT) or rest[len(_OPEN_ASSISTANT):].strip():
        what = ("continuing a partial assistant message" if rest.startswith(_OPEN_ASSISTANT)
                else "a gen outside an assistant turn")
        raise BackendCapabilityError(f"chat models cannot do {what}: put the gen first inside "
                                     "sgl.assistant(...), or use a completion model")
    return messages


def _looks_like_completion_model(model: str) -> bool:
    return model.startswith(("gpt-3.5-turbo-instruct", "davinci", "babbage")) or "-instruct-0914" in model


class OpenAI(Backend):
    """A Backend for an OpenAI-compatible server (see the module docstring)."""

    supports_streaming = True

    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None, *,
                 is_chat_model: bool | None = None, chat_template: ChatTemplate | str | None = None,
                 timeout: float | None = 600.0, **client_options: Any) -> None:
        import openai

        self.model = model
        self.base_url = base_url
        self.is_chat_model = (not _looks_like_completion_model(model)) if is_chat_model is None else is_chat_model
        # Completion endpoints return prompt logprobs (echo), which select needs.
        self.supports_logprobs = not self.is_chat_model
        self.tokenizer = None
        try:  # fail here, not in the first program, when no key can be found
            openai.AsyncOpenAI(api_key=api_key, base_url=base_url)
        except openai.OpenAIError as exc:
            if base_url is None:
                raise InvalidConfigError(f"OpenAI({model!r}): {exc}") from exc
            api_key = "EMPTY"  # no OPENAI_API_KEY: self-hosted servers usually need none
        self._clients: PerLoop[Any] = PerLoop(lambda: openai.AsyncOpenAI(
            api_key=api_key, base_url=base_url, timeout=timeout, **client_options))
        if isinstance(chat_template, str):
            chat_template = get_chat_template(chat_template)
        self._chat_template = chat_template or (_CHATML if self.is_chat_model else get_chat_template("default"))

    def get_chat_template(self) -> ChatTemplate:
        return self._chat_template

    # -- request building -----------------------------------------------------------------------

    def _arguments(self, params: SamplingParams, logprobs: LogprobOptions) -> dict[str, Any]:
        stop = [s for s in params.stop if not (self.is_chat_model and s in self._chat_template.stop_str)]
        args: dict[str, Any] = {"model": self.model, "max_tokens": params.max_new_tokens,
                                "temperature": params.temperature, "n": params.n}
        optional = {"top_p": (params.top_p, 1.0), "seed": (params.seed, None),
                    "frequency_penalty": (params.frequency_penalty, 0.0),
                    "presence_penalty": (params.presence_penalty, 0.0)}
        args.update({k: v for k, (v, default) in optional.items() if v != default})
        if stop:
            args["stop"] = stop
        if params.logit_bias:  # OpenAI's own field; JSON keys are strings
            args["logit_bias"] = {str(t): b for t, b in params.logit_bias.items()}
        extra: dict[str, Any] = {}
        sglang_extras = {"top_k": (params.top_k, -1), "min_p": (params.min_p, 0.0),
                         "repetition_penalty": (params.repetition_penalty, 1.0),
                         "min_tokens": (params.min_new_tokens, 0), "ignore_eos": (params.ignore_eos, False),
                         "stop_token_ids": (list(params.stop_token_ids), []),
                         "no_stop_trim": (params.no_stop_trim, False),
                         "stop_regex": (list(params.stop_regex), []),
                         "regex": (params.regex, None), "ebnf": (params.ebnf, None)}
        extra.update({k: v for k, (v, default) in sglang_extras.items() if v != default})
        if params.json_schema is not None:
            fmt = {"type": "json_schema",
                   "json_schema": {"name": "output", "schema": json.loads(params.json_schema)}}
            if self.is_chat_model:
                args["response_format"] = fmt
            else:
                extra["response_format"] = fmt
        if logprobs.return_logprob:
            if self.is_chat_model:
                if logprobs.wants_prompt_logprobs:
                    raise BackendCapabilityError("prompt logprobs (logprob_start_len >= 0) are not "
                                                 "available from chat models; use a completion model")
                args["logprobs"] = True
                if logprobs.top_logprobs_num:
                    args["top_logprobs"] = logprobs.top_logprobs_num
            else:
                args["logprobs"] = logprobs.top_logprobs_num
                if logprobs.wants_prompt_logprobs:
                    args["echo"] = True
        if extra:
            args["extra_body"] = extra
        return args

    async def _call(self, chat: bool, **args: Any) -> Any:
        import openai

        client = self._clients.get()
        try:
            if chat:
                return await client.chat.completions.create(**args)
            return await client.completions.create(**args)
        except openai.APIStatusError as exc:
            body = exc.body if isinstance(exc.body, dict) else {"message": str(exc)}
            raise remote_error(exc.status_code, body if "error" in body else {"error": body},
                               str(exc.request.url)) from exc
        except openai.APITimeoutError as exc:
            raise RequestTimeoutError(f"{self.model}: the server did not answer in time") from exc
        except openai.APIConnectionError as exc:
            raise EngineError(f"cannot reach {self.base_url or 'the OpenAI API'}: {exc}") from exc

    # -- Backend --------------------------------------------------------------------------------

    async def generate(self, prompt: Prompt, params: SamplingParams, logprobs: LogprobOptions
                       ) -> list[Completion]:
        args = self._arguments(params, logprobs)
        if self.is_chat_model:
            response = await self._call(True, messages=messages_from_text(prompt.text), **args)
        else:
            response = await self._call(False, prompt=prompt.text, **args)
        return [self._completion(response, c, prompt.text if args.get("echo") else None, len(response.choices))
                for c in response.choices]

    def _completion(self, response: Any, choice: Any, echoed: str | None, n: int) -> Completion:
        usage = getattr(response, "usage", None)
        details = getattr(usage, "prompt_tokens_details", None)
        meta: dict[str, Any] = {
            "id": response.id,
            "prompt_tokens": getattr(usage, "prompt_tokens", None),
            "completion_tokens": getattr(usage, "completion_tokens", None) if n == 1 else None,
            "cached_tokens": getattr(details, "cached_tokens", 0) or 0,
            "finish_reason": {"type": choice.finish_reason, "matched": getattr(choice, "matched_stop", None)},
        }
        if self.is_chat_model:
            text = choice.message.content or ""
            content = getattr(choice.logprobs, "content", None) or []
            if choice.logprobs is not None:
                meta["output_token_logprobs"] = [(t.logprob, None, t.token) for t in content]
                meta["output_top_logprobs"] = [[(x.logprob, None, x.token) for x in t.top_logprobs or []]
                                               for t in content]
        else:
            text = choice.text or ""
            if choice.logprobs is not None:
                rows = _completion_rows(choice.logprobs)
                split = len(rows)
                if echoed is not None:  # prompt tokens first: split where the output begins
                    offsets = choice.logprobs.text_offset or []
                    split = sum(1 for o in offsets if o < len(echoed))
                    text = text[len(echoed):] if text.startswith(echoed) else text
                meta["input_token_logprobs"] = rows[:split] if echoed is not None else []
                meta["output_token_logprobs"] = rows[split:] if echoed is not None else rows
        return Completion(text, None, meta, choice.finish_reason)

    async def stream(self, prompt: Prompt, params: SamplingParams, logprobs: LogprobOptions
                     ) -> AsyncIterator[CompletionChunk]:
        args = {**self._arguments(params, logprobs), "stream": True,
                "stream_options": {"include_usage": True}}
        if self.is_chat_model:
            stream = await self._call(True, messages=messages_from_text(prompt.text), **args)
        else:
            stream = await self._call(False, prompt=prompt.text, **args)
        text, reason, usage, rid = "", None, None, ""
        async for chunk in stream:
            rid, usage = chunk.id or rid, getattr(chunk, "usage", None) or usage
            for choice in chunk.choices or []:
                delta = (choice.delta.content or "") if self.is_chat_model else (choice.text or "")
                reason = choice.finish_reason or reason
                if delta:
                    text += delta
                    yield CompletionChunk(delta)
        meta = {"id": rid, "prompt_tokens": getattr(usage, "prompt_tokens", None),
                "completion_tokens": getattr(usage, "completion_tokens", None),
                "finish_reason": {"type": reason, "matched": None}}
        yield CompletionChunk("", None, Completion(text, None, meta, reason))

    async def select(self, prompt: Prompt, choices: Sequence[str], temperature: float,
                     method: ChoicesSamplingMethod) -> ChoicesDecision:
        if self.is_chat_model:
            raise BackendCapabilityError(
                f"select() needs prompt logprobs, which chat model {self.model!r} does not return "
                "over the OpenAI API; use a completion model (is_chat_model=False), "
                "sgl.RuntimeEndpoint, or gen(regex='(A|B)') to constrain the answer")
        # Only token texts come back, so choice tokens are compared, and rescored alone, as text.
        return await select_by_text(
            prompt.text, choices, method, self._echo_logprobs,
            lambda rows: self._echo_logprobs(["".join(t[2] or "" for t in row) for row in rows]), token_key=2)

    async def _echo_logprobs(self, texts: list[str]) -> list[list[TokenLogprobTuple]]:
        """Prompt token logprobs of each text (echo=True, logprobs=0): one generated token is
        requested, since some servers refuse max_tokens=0, and cut off by text offset."""
        response = await self._call(False, model=self.model, prompt=texts, max_tokens=1, temperature=0.0,
                                    echo=True, logprobs=0)
        rows: list[list[TokenLogprobTuple]] = [[] for _ in texts]
        for choice in response.choices:
            row = _completion_rows(choice.logprobs)
            offsets = choice.logprobs.text_offset or []
            keep = sum(1 for o in offsets if o < len(texts[choice.index]))
            rows[choice.index] = row[:keep]
        return rows

    async def aclose(self) -> None:
        await self._clients.aclose()


def _completion_rows(logprobs: Any) -> list[TokenLogprobTuple]:
    values = logprobs.token_logprobs or []
    return [(float("nan") if v is None else float(v), None, tok)  # type: ignore[misc]
            for tok, v in zip(logprobs.tokens or [], values)]
