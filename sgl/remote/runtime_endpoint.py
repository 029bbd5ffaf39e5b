"""RuntimeEndpoint: programs on a server speaking SGLang's native protocol (POST /generate).

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:30000"))

Works against `sgl serve` and against SGLang servers and routers. Two modes:

- text mode (default, no tokenizer here): each gen sends the program's text and the server
  tokenizes it. `select` asks the server for the prompt logprobs of prompt and prompt+choice in
  one batch (`max_new_tokens=0`, `logprob_start_len=0`); the token ids that come back locate
  each choice's tokens after the common prefix, exactly as the in-process backend does.
- token mode (`tokenizer=` a Hugging Face tokenizer or its name): the state's token ids are
  sent as `input_ids`, so generated tokens reach the server as the model produced them and the
  server's radix cache matches the whole prefix; `select` uses the base class on `score`.
"""

from __future__ import annotations

import math
from typing import Any, AsyncIterator, Sequence

from sgl.errors import EngineError
from sgl.lang.backend import Backend, Completion, CompletionChunk, Prompt, TokenLogprobTuple
from sgl.lang.chat import ChatTemplate, get_chat_template
from sgl.lang.choices import ChoicesDecision, ChoicesSamplingMethod
from sgl.remote.http import PerLoop, raise_for_status, sse_events
from sgl.remote.select import select_by_text
from sgl.remote.templates import template_from_model_info
from sgl.sampling import LogprobOptions, SamplingParams

__all__ = ["RuntimeEndpoint"]

_DEFAULTS = SamplingParams().to_dict()


def sampling_payload(params: SamplingParams) -> dict[str, Any]:
    """Only the fields that differ from the defaults: an SGLang server rejects names it does
    not know, and defaults need not travel."""
    out = {k: v for k, v in params.to_dict().items() if v != _DEFAULTS[k]}
    if "seed" in out:
        out["sampling_seed"] = out.pop("seed")  # SGLang's name; sgl serve takes both
    return out



def _row(entries: Any) -> list[TokenLogprobTuple]:
    return [(math.nan if lp is None else float(lp), int(tid), text) for lp, tid, text in entries or []]


def _completion(result: dict[str, Any]) -> Completion:
    meta = dict(result.get("meta_info") or {})
    for key in ("input_token_logprobs", "output_token_logprobs"):
        if key in meta:
            meta[key] = _row(meta[key])
    for key in ("input_top_logprobs", "output_top_logprobs"):
        if key in meta:
            meta[key] = [_row(r) if r is not None else [] for r in meta[key]]
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    ids = result.get("output_ids")
    return Completion(result.get("text", ""), list(ids) if ids is not None else None, meta, kind)


class RuntimeEndpoint(Backend):
    """A Backend for a server speaking SGLang's native protocol (see the module docstring)."""

    supports_logprobs = True
    supports_streaming = True

    def __init__(self, base_url: str, api_key: str | None = None, *,
                 chat_template: ChatTemplate | str | None = None, tokenizer: Any = None,
                 timeout: float | None = 600.0, verify: bool = True) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout
        self._clients: PerLoop[httpx.AsyncClient] = PerLoop(lambda: httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers, timeout=timeout, verify=verify))
        # Like SGLang's client: a synchronous probe at construction, so a wrong URL or key
        # fails here rather than inside the first program.
        try:
            response = httpx.get(self.base_url + "/get_model_info", headers=self._headers,
                                 timeout=timeout, verify=verify)
        except httpx.HTTPError as exc:
            raise EngineError(f"cannot reach {self.base_url}: {exc}") from exc
        raise_for_status(response)
        self.model_info: dict[str, Any] = response.json()
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.tokenizer = tokenizer
        if isinstance(chat_template, str):
            chat_template = get_chat_template(chat_template)
        self._chat_template = chat_template

    def get_chat_template(self) -> ChatTemplate:
        if self._chat_template is None:
            self._chat_template = template_from_model_info(self.model_info)
        return self._chat_template

    # -- requests -----------------------------------------------------------------------------

    def _prompt_fields(self, prompt: Prompt) -> dict[str, Any]:
        if self.tokenizer is not None and prompt.token_ids is not None:
            return {"input_ids": list(prompt.token_ids)}
        return {"text": prompt.text}

    async def _post(self, payload: dict[str, Any]) -> Any:
        import httpx

        try:
            response = await self._clients.get().post("/generate", json=payload)
        except httpx.HTTPError as exc:
            raise EngineError(f"{self.base_url}/generate failed: {type(exc).__name__}: {exc}") from exc
        raise_for_status(response)
        return response.json()

    def _payload(self, prompt: Prompt, params: SamplingParams, logprobs: LogprobOptions) -> dict[str, Any]:
        payload = {**self._prompt_fields(prompt), "sampling_params": sampling_payload(params)}
        if logprobs.return_logprob:
            payload.update(return_logprob=True, logprob_start_len=logprobs.logprob_start_len,
                           top_logprobs_num=logprobs.top_logprobs_num, return_text_in_logprobs=True)
        return payload

    async def generate(self, prompt: Prompt, params: SamplingParams, logprobs: LogprobOptions
                       ) -> list[Completion]:
        result = await self._post(self._payload(prompt, params, logprobs))
        results = result if isinstance(result, list) else [result]
        return [_completion(r) for r in results]

    async def stream(self, prompt: Prompt, params: SamplingParams, logprobs: LogprobOptions
                     ) -> AsyncIterator[CompletionChunk]:
        import httpx

        payload = {**self._payload(prompt, params, logprobs), "stream": True}
        text, ids = "", 0
        try:
            async with self._clients.get().stream("POST", "/generate", json=payload) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise_for_status(response)
                async for event in sse_events(response.aiter_lines()):
                    new = event.get("text", "")
                    # Cumulative text (SGLang's default); tolerate servers sending increments.
                    delta = new[len(text):] if new.startswith(text) else new
                    text = new if new.startswith(text) else text + new
                    out_ids = event.get("output_ids")
                    delta_ids = list(out_ids[ids:]) if out_ids is not None else None
                    ids = len(out_ids) if out_ids is not None else ids
                    reason = (event.get("meta_info") or {}).get("finish_reason")
                    final = _completion({**event, "text": text}) if reason is not None else None
                    yield CompletionChunk(delta, delta_ids, final)
        except httpx.HTTPError as exc:
            raise EngineError(f"{self.base_url}/generate stream failed: {exc}") from exc

    async def score(self, prompts: Sequence[Sequence[int]], logprob_start_len: int
                    ) -> list[list[TokenLogprobTuple]]:
        result = await self._post({
            "input_ids": [list(p) for p in prompts],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": logprob_start_len})
        rows = []
        for ids, r in zip(prompts, result):
            row = _row(r["meta_info"].get("input_token_logprobs"))
            missing = len(ids) - logprob_start_len - len(row)  # a server may omit position 0
            rows.append([(math.nan, ids[logprob_start_len + i], None) for i in range(max(missing, 0))] + row)
        return rows

    async def _text_logprobs(self, texts: list[str]) -> list[list[TokenLogprobTuple]]:
        result = await self._post({
            "text": texts, "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": 0, "return_text_in_logprobs": True})
        return [_row(r["meta_info"].get("input_token_logprobs")) for r in result]

    async def select(self, prompt: Prompt, choices: Sequence[str], temperature: float,
                     method: ChoicesSamplingMethod) -> ChoicesDecision:
        if self.tokenizer is not None and prompt.token_ids is not None:
            return await super().select(prompt, choices, temperature, method)
        # Text mode: the server's tokenization of prompt and prompt+choice, in one request.
        return await select_by_text(
            prompt.text, choices, method, self._text_logprobs,
            lambda rows: self.score([[t[1] for t in row] for row in rows], 0), token_key=1)

    async def cache_prefix(self, prompt: Prompt) -> None:
        if prompt.text or prompt.token_ids:
            await self._post({**self._prompt_fields(prompt), "sampling_params": {"max_new_tokens": 0}})

    async def flush_cache(self) -> bool:
        response = await self._clients.get().post("/flush_cache")
        return response.status_code == 200

    def get_server_info(self) -> dict[str, Any]:
        import httpx

        response = httpx.get(self.base_url + "/get_server_info", headers=self._headers, timeout=self._timeout)
        raise_for_status(response)
        return response.json()

    async def aclose(self) -> None:
        await self._clients.aclose()
