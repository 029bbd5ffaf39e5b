"""EngineBackend: programs on an in-process `sgl.Engine`, sending token ids.

Each gen sends the state's token ids (`input_ids`), so the engine's radix cache matches the
whole prefix, generated tokens included, instead of re-tokenizing the text. `select` scores
all choices in one batched `engine.generate([...], max_new_tokens=0, return_logprob=True,
logprob_start_len=L)` call (see Backend.select for the token boundary).

Coded against the Engine facade only (generate / stream / tokenizer / apply_chat_template /
flush_cache / stats); the engine module is never imported here.
"""

from __future__ import annotations

import math
from typing import Any, AsyncIterator, Sequence

from sgl.lang.backend import Backend, Completion, CompletionChunk, Prompt, TokenLogprobTuple
from sgl.lang.chat import ChatTemplate, chat_template_from_tokenizer, get_chat_template
from sgl.sampling import LogprobOptions, SamplingParams

__all__ = ["EngineBackend"]


class EngineBackend(Backend):
    supports_logprobs = True
    supports_streaming = True

    def __init__(self, engine: Any, chat_template: ChatTemplate | str | None = None) -> None:
        self.engine = engine
        self.tokenizer = getattr(engine, "tokenizer", None)
        if isinstance(chat_template, str):
            chat_template = get_chat_template(chat_template)
        self._chat_template = chat_template

    def get_chat_template(self) -> ChatTemplate:
        if self._chat_template is None:
            try:
                self._chat_template = chat_template_from_tokenizer(self.tokenizer)
            except (ValueError, AttributeError):  # no usable template: plain-text roles
                self._chat_template = get_chat_template("default")
        return self._chat_template

    def _input(self, prompt: Prompt) -> str | list[int]:
        return list(prompt.token_ids) if prompt.token_ids is not None else prompt.text

    async def generate(self, prompt: Prompt, params: SamplingParams, logprobs: LogprobOptions
                       ) -> list[Completion]:
        out = await self.engine.generate(
            self._input(prompt), params, return_logprob=logprobs.return_logprob,
            logprob_start_len=logprobs.logprob_start_len, top_logprobs_num=logprobs.top_logprobs_num)
        outputs = out if isinstance(out, list) else [out]
        return [_completion(o) for o in outputs]

    async def stream(self, prompt: Prompt, params: SamplingParams, logprobs: LogprobOptions
                     ) -> AsyncIterator[CompletionChunk]:
        async for chunk in self.engine.stream(
            self._input(prompt), params, return_logprob=logprobs.return_logprob,
            logprob_start_len=logprobs.logprob_start_len, top_logprobs_num=logprobs.top_logprobs_num):
            final = _completion(chunk.output) if getattr(chunk, "output", None) is not None else None
            yield CompletionChunk(chunk.text, list(chunk.token_ids), final)

    async def score(self, prompts: Sequence[Sequence[int]], logprob_start_len: int
                    ) -> list[list[TokenLogprobTuple]]:
        outs = await self.engine.generate(
            [list(p) for p in prompts], {"max_new_tokens": 0, "temperature": 0.0},
            return_logprob=True, logprob_start_len=logprob_start_len)
        outs = outs if isinstance(outs, list) else [outs]
        rows = []
        for ids, out in zip(prompts, outs):
            entries = out.logprobs.prompt if out.logprobs is not None else []
            row = [(_nan_if_none(e.logprob), e.token_id, e.text) for e in entries]
            # Defensive: an engine may omit position 0's (undefined) logprob; realign so that
            # row[i] is always the token at logprob_start_len + i.
            missing = len(ids) - logprob_start_len - len(row)
            if missing > 0:
                row = [(math.nan, ids[logprob_start_len + i], None) for i in range(missing)] + row
            rows.append(row)
        return rows

    async def cache_prefix(self, prompt: Prompt) -> None:
        await self.engine.generate(self._input(prompt), {"max_new_tokens": 0})

    async def flush_cache(self) -> bool:
        result = self.engine.flush_cache()
        if hasattr(result, "__await__"):
            result = await result
        return True if result is None else bool(result)

    def get_server_info(self) -> dict[str, Any]:
        stats = getattr(self.engine, "stats", None)
        info = {"backend": "EngineBackend"}
        if callable(stats):
            info["stats"] = stats()
        return info


def _nan_if_none(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _completion(out: Any) -> Completion:
    """GenerateOutput -> Completion with SGLang's meta_info keys."""
    usage = out.usage
    meta: dict[str, Any] = {
        "id": getattr(out, "request_id", ""),
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cached_tokens": usage.cached_tokens,
        "finish_reason": {"type": out.finish_reason, "matched": out.matched_stop},
        "output": out,
    }
    lp = out.logprobs
    if lp is not None:
        def rows(entries: Any) -> list[tuple[float, int, str | None]]:
            return [(_nan_if_none(e.logprob), e.token_id, e.text) for e in entries]

        meta["input_token_logprobs"] = rows(lp.prompt)
        meta["output_token_logprobs"] = rows(lp.output)
        meta["input_top_logprobs"] = [rows(r) for r in lp.prompt_top]
        meta["output_top_logprobs"] = [rows(r) for r in lp.output_top]
    return Completion(out.text, list(out.token_ids), meta, out.finish_reason)
