"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Requests are translated to engine jobs by `openai_requests`; this module runs them and writes
OpenAI's response and chunk objects. Any `model` name is accepted (the server hosts one model)
so clients that hard-code a name still work; responses report the served name.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from sgl.outputs import GenerateOutput, StreamChunk, TokenLogprob, ToolCallDelta

from sgl.backend.server.context import ServerContext, context_of
from sgl.backend.server.driver import failed_before_start, run_or_abort
from sgl.backend.server.openai_requests import OpenAIRequest, parse_chat, parse_completion
from sgl.backend.server.protocol import (SSE_DONE, ApiError, TokenTexts, error_from_exception, finite,
                                         json_response, sse)

__all__ = ["routes_spec"]


# Engine field names -> the OpenAI request fields they come from.
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                 "input_ids": "prompt", "top_logprobs_num": "top_logprobs"}


def _error(exc: BaseException, chat: bool) -> ApiError:
    err = error_from_exception(exc)
    names = {**_OPENAI_NAMES, "prompt": "messages"} if chat else _OPENAI_NAMES
    err.param = names.get(err.param, err.param) if err.param else None
    return err


def _finish(reason: str | None, out: GenerateOutput | None = None) -> str | None:
    # "stop" / "length" as OpenAI; "abort" only for requests cut short; "tool_calls" when the
    # model ended after calling tools.
    if reason == "stop" and out is not None and out.tool_calls:
        return "tool_calls"
    return reason


# -- tool calls and reasoning in OpenAI's shapes -----------------------------------------------


def _chat_message(out: GenerateOutput) -> dict[str, Any]:
    content = out.content if out.content is not None else out.text
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if out.reasoning is not None:
        message["reasoning_content"] = out.reasoning
    if out.tool_calls is not None:
        message["content"] = content or None  # OpenAI: null when the answer is only calls
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments_json}}
                                 for c in out.tool_calls]
    return message


def _tool_call_deltas(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """OpenAI's delta.tool_calls: a call's first entry has id, type and name; pieces of the
    same call within one chunk are merged."""
    merged: list[dict[str, Any]] = []
    for d in deltas:
        if merged and merged[-1]["index"] == d.index and d.id is None:
            merged[-1]["function"]["arguments"] += d.arguments
            continue
        entry: dict[str, Any] = {"index": d.index, "function": {"arguments": d.arguments}}
        if d.id is not None:
            entry.update(id=d.id, type="function")
            entry["function"]["name"] = d.name
        merged.append(entry)
    return merged


def _chat_delta(chunk: StreamChunk, started: bool) -> dict[str, Any]:
    out = chunk.output
    text = chunk.content if chunk.content is not None else chunk.text
    delta: dict[str, Any] = {} if out is not None and not text else {"content": text}
    if chunk.reasoning:
        delta["reasoning_content"] = chunk.reasoning
    if chunk.tool_calls:
        delta["tool_calls"] = _tool_call_deltas(chunk.tool_calls)
    if (chunk.reasoning or chunk.tool_calls) and not text:
        delta.pop("content", None)
    if not started:
        delta = {"role": "assistant", **delta, "content": delta.get("content", "")}
    return delta


# -- logprobs in the two OpenAI shapes --------------------------------------------------------


def _chat_logprobs(entries: list[TokenLogprob], tops: list[list[TokenLogprob]], want_top: int,
                   texts: TokenTexts) -> dict[str, Any]:
    def item(e: TokenLogprob) -> dict[str, Any]:
        text = texts(e.token_id)
        return {"token": text, "logprob": finite(e.logprob), "bytes": list(text.encode())}

    content = []
    for i, e in enumerate(entries):
        row = item(e)
        row["top_logprobs"] = [item(t) for t in tops[i][:want_top]] if want_top and i < len(tops) else []
        content.append(row)
    return {"content": content}


def _completion_logprobs(entries: list[TokenLogprob], tops: list[list[TokenLogprob] | None],
                         want_top: int, texts: TokenTexts, offset: int) -> dict[str, Any]:
    tokens, values, top_rows, offsets = [], [], [], []
    for i, e in enumerate(entries):
        text = texts(e.token_id)
        tokens.append(text)
        values.append(finite(e.logprob))
        offsets.append(offset)
        offset += len(text)
        row = tops[i] if i < len(tops) else None
        top_rows.append({texts(t.token_id): finite(t.logprob) for t in row[:want_top]}
                        if row is not None and want_top else None)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top_rows, "text_offset": offsets}


def _output_logprobs(req: OpenAIRequest, out: GenerateOutput, texts: TokenTexts,
                     prompt_text: str) -> dict[str, Any] | None:
    lp = out.logprobs
    if not req.job.logprob.return_logprob or lp is None:
        return None
    if req.chat:
        return _chat_logprobs(lp.output, lp.output_top, req.top_logprobs, texts)
    entries, tops = list(lp.output), list(lp.output_top)
    start = len(prompt_text) if req.echo else 0
    if req.echo:  # prompt tokens first; the first one has no logprob and no distribution
        prompt_tops: list[Any] = [t or None for t in lp.prompt_top] or [None] * len(lp.prompt)
        entries, tops, start = list(lp.prompt) + entries, prompt_tops + tops, 0
    return _completion_logprobs(entries, tops, req.top_logprobs, texts, start)


def _usage(outs: list[GenerateOutput], n: int) -> dict[str, Any]:
    firsts = outs[::n]  # the prompt is counted once per prompt, not once per sample
    prompt = sum(o.usage.prompt_tokens for o in firsts)
    completion = sum(o.usage.completion_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.usage.cached_tokens for o in firsts)}}


# -- handlers ---------------------------------------------------------------------------------


async def models(request: Request) -> Response:
    ctx = context_of(request)
    return json_response({"object": "list", "data": [{
        "id": ctx.model_name, "object": "model", "created": int(ctx.started), "owned_by": "sgl",
        "root": ctx.model_path, "max_model_len": ctx.engine.context_length}]})


async def completions(request: Request) -> Response:
    return await _handle(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _handle(request, chat=True)


async def _handle(request: Request, chat: bool) -> Response:
    ctx = context_of(request)
    route = "chat" if chat else "completions"
    start = time.monotonic()
    try:
        body = await ctx.read_body(request)
        reqs = (parse_chat if chat else parse_completion)(body, ctx.engine, ctx.options)
    except Exception as exc:  # noqa: BLE001 - ApiError or an engine validation error
        ctx.metrics.count_request(route, "invalid")
        return _error(exc, chat).response()
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    if reqs[0].stream:
        return await _stream(request, ctx, reqs, rid, route, start)
    try:
        outs = await run_or_abort(request.receive, ctx.driver.run([r.job for r in reqs]))
    except Exception as exc:  # noqa: BLE001 - a disconnect, or any failure as a JSON error
        return failed_before_start(exc, ctx.metrics, route, lambda e: _error(e, chat))
    ctx.metrics.count_request(route, "ok")
    n = reqs[0].job.n
    choices = []
    for slot, out in enumerate(outs):
        req = reqs[slot // n]
        logprobs = _output_logprobs(req, out, ctx.texts, req.prompt_text)
        if chat:
            choices.append({"index": slot, "message": _chat_message(out),
                            "logprobs": logprobs, "finish_reason": _finish(out.finish_reason, out),
                            "matched_stop": out.matched_stop})
        else:
            text = (req.prompt_text + out.text) if req.echo else out.text
            choices.append({"index": slot, "text": text, "logprobs": logprobs,
                            "finish_reason": _finish(out.finish_reason), "matched_stop": out.matched_stop})
    return json_response({
        "id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
        "model": ctx.model_name, "choices": choices, "usage": _usage(outs, n),
        "system_fingerprint": None})


def _stream_choice(req: OpenAIRequest, slot: int, chunk: StreamChunk, started: bool,
                   texts: TokenTexts) -> dict[str, Any]:
    """One choice of a streamed chunk (the first one of a chat slot opens the assistant role)."""
    chat, out = req.chat, chunk.output
    logprobs = None
    if req.job.logprob.return_logprob and chunk.logprobs:
        if chat:
            logprobs = _chat_logprobs(chunk.logprobs, [], 0, texts)
        else:
            logprobs = _completion_logprobs(chunk.logprobs, [], 0, texts, 0)
    if chat:
        body: dict[str, Any] = {"index": slot, "delta": _chat_delta(chunk, started), "logprobs": logprobs}
    else:
        text = chunk.text if started or not req.echo else req.prompt_text + chunk.text
        body = {"index": slot, "text": text, "logprobs": logprobs}
    body["finish_reason"] = _finish(out.finish_reason, out) if out is not None else None
    if out is not None:
        body["matched_stop"] = out.matched_stop
    return body


async def _stream(request: Request, ctx: ServerContext, reqs: list[OpenAIRequest], rid: str,
                  route: str, start: float) -> Response:
    chat, n = reqs[0].chat, reqs[0].job.n
    events = ctx.driver.stream([r.job for r in reqs], start)
    try:  # prime: a bad request is still answered with a 4xx, not a broken stream
        first = await run_or_abort(request.receive, events.__anext__())
    except Exception as exc:  # noqa: BLE001
        return failed_before_start(exc, ctx.metrics, route, lambda e: _error(e, chat))
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def frame(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        return sse({"id": rid, "object": kind, "created": created, "model": ctx.model_name,
                    "choices": choices, "usage": usage})

    def choice(slot: int, chunk: StreamChunk, started: bool) -> dict[str, Any]:
        return _stream_choice(reqs[slot // n], slot, chunk, started, ctx.texts)

    async def body() -> AsyncIterator[bytes]:
        started: set[int] = set()
        finals: dict[int, GenerateOutput] = {}
        outcome = "disconnected"
        try:
            item: tuple[int, StreamChunk] | None = first
            while item is not None:
                slot, chunk = item
                yield frame([choice(slot, chunk, slot in started)])
                started.add(slot)
                if chunk.output is not None:
                    finals[slot] = chunk.output
                item = await anext(events, None)
            if reqs[0].include_usage:
                yield frame([], _usage([finals[i] for i in sorted(finals)], n))
            outcome = "ok"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the status line is gone: report in-band
            outcome = "error"
            yield sse(error_from_exception(exc).body())
        finally:
            ctx.metrics.count_request(route, outcome)
            await events.aclose()
        yield SSE_DONE

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def routes_spec() -> list[tuple[str, Any, list[str]]]:
    return [
        ("/v1/models", models, ["GET"]),
        ("/v1/completions", completions, ["POST"]),
        ("/v1/chat/completions", chat_completions, ["POST"]),
    ]

