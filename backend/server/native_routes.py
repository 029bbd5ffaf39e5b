"""SGLang's native HTTP protocol: /generate, /get_model_info, /get_server_info, /flush_cache,
/health, /health_generate.

Request and response shapes follow SGLang's server so that its `RuntimeEndpoint` (and ours,
`sgl.RuntimeEndpoint`) work unchanged. Token logprobs are `[logprob, token_id, text|null]`
with null for the first prompt token (JSON has no NaN). A single prompt with n > 1, or a
batch, answers with a list (flattened over n). Streaming sends SSE `data: {...}` events whose
`text` is cumulative, each tagged with `index`, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse

from sgl.outputs import GenerateOutput, TokenLogprob
from sgl.sampling import LogprobOptions, SamplingParams

from sgl.backend.server.context import ServerContext, context_of, engine_problem
from sgl.backend.server.driver import Job, failed_before_start, run_or_abort
from sgl.backend.server.options import ServerOptions
from sgl.backend.server.protocol import (SSE_DONE, ApiError, TokenTexts, error_from_exception, finite,
                                         json_response, sse)
from sgl.backend.server.validate import (Fields, as_bool, as_int, as_str, bad, check_batch, check_sampling,
                                         check_token_ids, encode_text, over_limit, show)

__all__ = ["routes_spec"]

# Fields of SGLang's GenerateReqInput (0.5.x) that we accept only with their "off" value:
# multimodal inputs, LoRA, sessions, disaggregation and data-parallel routing, extra outputs.
_OFF_FIELDS = ("image_data", "audio_data", "video_data", "input_embeds", "mm_hashes", "mm_content_hashes",
               "video_config", "watermark", "token_ids_logprob", "sampling_logprobs_mode", "lora_path",
               "lora_id", "custom_logit_processor", "positional_embed_overrides", "session_params",
               "session_id", "modalities", "bootstrap_host", "bootstrap_port", "bootstrap_room",
               "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank", "data_parallel_rank",
               "disagg_prefill_dp_rank")
_OFF_FLAGS = ("return_hidden_states", "return_sampling_mask", "return_flat_raw_top_logprobs",
              "return_flat_raw_output_top_logprobs", "return_routed_experts", "return_indexer_topk",
              "use_audio_in_video", "background", "require_reasoning")
# Routing hints of SGLang's router and HTTP workers: meaningless for one in-process engine.
_IGNORED = ("rid", "stream_options", "log_metrics", "routing_key", "conversation_id", "http_worker_ipc")
# SGLang sampling fields accepted only with their "off" value (a 400 names them otherwise).
_OFF_SAMPLING = {"beam_width": (None, 1), "structural_tag": (None, ""), "watermark": (None,)}


@dataclasses.dataclass
class _Options:
    logprob: LogprobOptions
    text_in_logprobs: bool


def _per_prompt(f: Fields, key: str, check: Callable[[Any, str], Any], default: Any, count: int) -> list[Any]:
    """SGLang lets per-request options be one value or a list with one value per prompt."""
    value = f.raw(key, default)
    if not isinstance(value, list):
        return [check(value, key)] * count
    if len(value) != count:
        raise ApiError(400, f"{key} has {len(value)} entries for {count} prompts", key)
    return [check(v, f"{key}[{i}]") for i, v in enumerate(value)]


def _sampling(raw: Any, where: str, options: ServerOptions) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise bad(where, "an object of sampling parameters", raw)
    params = {k: v for k, v in raw.items() if v is not None}  # SGLang clients send nulls
    if "sampling_seed" in params:  # newer SGLang's name for the seed
        params["seed"] = params.pop("sampling_seed")
    _check_ignored_sampling(params, where)
    unknown = sorted(set(params) - SamplingParams.field_names())
    if unknown:
        raise ApiError(400, f"unknown sampling parameter(s) {unknown}; known: "
                            f"{sorted(SamplingParams.field_names())}", f"{where}.{unknown[0]}")
    return {k: check_sampling(k, v, f"{where}.{k}", options) for k, v in params.items()}


def _check_ignored_sampling(params: dict[str, Any], where: str) -> None:
    """Type-check, then drop, the SGLang sampling fields that do not change what one in-process
    engine produces: stream_interval batches streamed tokens (sgl streams every token),
    custom_params feeds custom logit processors (refused as custom_logit_processor)."""
    interval = params.pop("stream_interval", None)
    if interval is not None:
        as_int(interval, f"{where}.stream_interval", lo=1)
    custom = params.pop("custom_params", None)
    if custom is not None and not isinstance(custom, dict):
        raise bad(f"{where}.custom_params", "an object", custom)
    for key, allowed in _OFF_SAMPLING.items():
        value = params.pop(key, None)
        if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
            raise ApiError(400, f"{where}.{key}={show(value)} is not supported by this server "
                                f"(accepted: {[a for a in allowed if a is not None] or 'null'})", f"{where}.{key}")


def _prompts(f: Fields) -> tuple[list[Any], bool]:
    """-> prompts, single (one prompt given bare: answer with an object, not a list)."""
    text, ids = f.raw("text"), f.raw("input_ids")
    if text is not None and ids is not None:
        raise ApiError(400, "give either text or input_ids, not both", "input_ids")
    if text is None and ids is None:
        raise ApiError(400, "text or input_ids is required", "text")
    if text is not None:
        if isinstance(text, str):
            return [text], True
        if not isinstance(text, list) or not text:
            raise bad("text", "a string or a non-empty list of strings", text)
        return [as_str(t, f"text[{i}]") for i, t in enumerate(text)], False
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return [check_token_ids(p, f"input_ids[{i}]") for i, p in enumerate(ids)], False
    return [check_token_ids(ids, "input_ids")], True


def _bounded_top(value: Any, name: str, options: ServerOptions) -> int:
    top = as_int(value, name, lo=0)
    if top > options.max_top_logprobs_num:
        raise over_limit(name, f"{top} top logprobs", options.max_top_logprobs_num, "max_top_logprobs_num")
    return top


def parse_generate(body: dict[str, Any], engine: Any, options: ServerOptions
                   ) -> tuple[list[Job], list[_Options], bool, bool]:
    """-> jobs, per-job output options, single (answer with an object, not a list), stream."""
    f = Fields(body, options=options)
    prompts, single = _prompts(f)
    count = len(prompts)
    sp = f.raw("sampling_params", {})
    sps = sp if isinstance(sp, list) else [sp] * count
    if len(sps) != count:
        raise ApiError(400, f"sampling_params has {len(sps)} entries for {count} prompts", "sampling_params")
    params = [_sampling(p, "sampling_params" if not isinstance(sp, list) else f"sampling_params[{i}]", options)
              for i, p in enumerate(sps)]
    check_batch(sum(p.get("n", 1) for p in params), options, "sampling_params.n" if single else "text")
    want = _per_prompt(f, "return_logprob", as_bool, False, count)
    starts = _per_prompt(f, "logprob_start_len", lambda v, k: as_int(v, k, lo=-1), -1, count)
    tops = _per_prompt(f, "top_logprobs_num", lambda v, k: _bounded_top(v, k, options), 0, count)
    text_in = f.boolean("return_text_in_logprobs")
    stream = f.boolean("stream")
    timeout = f.number("timeout")
    f.ignore(*_IGNORED)
    for key in _OFF_FLAGS:
        f.unsupported(key, allowed=(None, False))
    f.unsupported("routed_experts_start_len", allowed=(None, 0))
    for key in _OFF_FIELDS:
        f.unsupported(key)
    f.reject_unknown()
    jobs, opts = [], []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):  # tokenized here, last: the engine then gets the ids
            prompt = encode_text(engine, prompt, "text" if single else f"text[{i}]")
        try:
            lp = LogprobOptions(want[i], starts[i], tops[i])
        except Exception as exc:  # noqa: BLE001 - InvalidSamplingParamsError with .field
            raise error_from_exception(exc) from None
        jobs.append(Job(prompt, params[i], lp, timeout))
        opts.append(_Options(lp, text_in))
    return jobs, opts, single, stream


def _rows(entries: list[TokenLogprob], opts: _Options, texts: TokenTexts) -> list[list[Any]]:
    return [[finite(e.logprob), e.token_id, texts(e.token_id) if opts.text_in_logprobs else None]
            for e in entries]


def _finish_reason(out: GenerateOutput) -> dict[str, Any]:
    reason: dict[str, Any] = {"type": out.finish_reason, "matched": out.matched_stop}
    if out.finish_reason == "length":
        reason["length"] = out.usage.completion_tokens
    if out.finish_reason == "abort":
        reason["message"] = out.error
    return reason


def native_output(out: GenerateOutput, opts: _Options, texts: TokenTexts, latency: float) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": out.request_id,
        "prompt_tokens": out.usage.prompt_tokens,
        "completion_tokens": out.usage.completion_tokens,
        "cached_tokens": out.usage.cached_tokens,
        "finish_reason": _finish_reason(out),
        "e2e_latency": latency,
    }
    if opts.logprob.return_logprob:
        lp = out.logprobs
        prompt = _rows(lp.prompt, opts, texts) if lp else []
        meta["input_token_logprobs"] = prompt
        meta["output_token_logprobs"] = _rows(lp.output, opts, texts) if lp else []
        # the first prompt token has no distribution: the engine gives [], SGLang says null
        in_top: list[Any] = [_rows(r, opts, texts) if r else None for r in lp.prompt_top] if lp else []
        meta["input_top_logprobs"] = in_top
        meta["output_top_logprobs"] = [_rows(r, opts, texts) for r in lp.output_top] if lp else []
        values = [v for v, _, _ in prompt if v is not None]
        meta["normalized_prompt_logprob"] = sum(values) / len(values) if values else None
    return {"text": out.text, "output_ids": list(out.token_ids), "meta_info": meta}


async def generate(request: Request) -> Response:
    ctx = context_of(request)
    start = time.monotonic()
    try:
        jobs, options, single, stream = parse_generate(await ctx.read_body(request), ctx.engine, ctx.options)
    except ApiError as exc:
        ctx.metrics.count_request("generate", "invalid")
        return exc.response()
    opts_of = [o for job, o in zip(jobs, options) for _ in range(job.n)]  # by slot
    if stream:
        return await _stream(request, ctx, jobs, opts_of, start)
    try:
        outs = await run_or_abort(request.receive, ctx.driver.run(jobs))
    except Exception as exc:  # noqa: BLE001 - a disconnect, or any failure as a JSON error
        return failed_before_start(exc, ctx.metrics, "generate", _generate_error)
    ctx.metrics.count_request("generate", "ok")
    latency = time.monotonic() - start
    results = [native_output(o, opts_of[i], ctx.texts, latency) for i, o in enumerate(outs)]
    return json_response(results[0] if single and len(results) == 1 else results)


def _generate_error(exc: Exception) -> ApiError:
    return error_from_exception(exc, "sampling_params")  # fields live under sampling_params


async def _stream(request: Request, ctx: ServerContext, jobs: list[Job], opts_of: list[_Options],
                  start: float) -> Response:
    events = ctx.driver.stream(jobs, start)
    try:  # prime: validation errors surface here, before the 200 status line is sent
        first = await run_or_abort(request.receive, events.__anext__())
    except Exception as exc:  # noqa: BLE001
        return failed_before_start(exc, ctx.metrics, "generate", _generate_error)

    async def body() -> AsyncIterator[bytes]:
        text: dict[int, str] = {}
        ids: dict[int, list[int]] = {}
        lps: dict[int, list[TokenLogprob]] = {}
        outcome = "disconnected"  # unless we reach the end
        try:
            item: tuple[int, Any] | None = first
            while item is not None:
                slot, chunk = item
                opts = opts_of[slot]
                if chunk.output is not None:
                    out = native_output(chunk.output, opts, ctx.texts, time.monotonic() - start)
                else:
                    text[slot] = text.get(slot, "") + chunk.text
                    ids.setdefault(slot, []).extend(chunk.token_ids)
                    lps.setdefault(slot, []).extend(chunk.logprobs or [])
                    meta: dict[str, Any] = {"id": "", "completion_tokens": len(ids[slot]),
                                            "finish_reason": None}
                    if opts.logprob.return_logprob:
                        meta["output_token_logprobs"] = _rows(lps[slot], opts, ctx.texts)
                    out = {"text": text[slot], "output_ids": ids[slot], "meta_info": meta}
                yield sse({**out, "index": slot})
                item = await anext(events, None)
            outcome = "ok"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            outcome = "error"
            yield sse(error_from_exception(exc).body())
        finally:
            ctx.metrics.count_request("generate", outcome)
            await events.aclose()  # aborts whatever is still running (client gone)
        yield SSE_DONE

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def get_model_info(request: Request) -> Response:
    ctx = context_of(request)
    tok = ctx.engine.tokenizer
    template = getattr(tok, "chat_template", None)
    return json_response({
        "model_path": ctx.model_path,
        "tokenizer_path": ctx.engine.config.tokenizer or ctx.model_path,
        "served_model_name": ctx.model_name,
        "is_generation": True,
        "context_length": ctx.engine.context_length,
        "vocab_size": ctx.engine.model_config.vocab_size,
        # sgl extras: RuntimeEndpoint derives role strings from the model's own template
        "chat_template": template if isinstance(template, str) else None,
        "bos_token": getattr(tok, "bos_token", None),
        "eos_token": getattr(tok, "eos_token", None),
    })


async def get_server_info(request: Request) -> Response:
    ctx = context_of(request)
    config = {k: v for k, v in dataclasses.asdict(ctx.engine.config).items()
              if isinstance(v, (str, int, float, bool, type(None)))}
    stats = dataclasses.asdict(ctx.engine.stats())
    return json_response({**config, "version": _version(), "served_model_name": ctx.model_name,
                          "max_total_num_tokens": ctx.engine.config.max_total_tokens,
                          "uptime_s": time.time() - ctx.started, "stats": stats})


async def flush_cache(request: Request) -> Response:
    ctx = context_of(request)
    done = await asyncio.to_thread(ctx.engine.flush_cache)
    if done:
        return PlainTextResponse("Cache flushed.\n")
    return ApiError(400, "requests are running; flush the cache when the server is idle",
                    type="conflict").response()


async def health(request: Request) -> Response:
    """200 while the engine can serve; 503 once it is closed or its thread died, so that a
    supervisor (systemd, Kubernetes) restarts the process instead of routing to a dead one."""
    problem = engine_problem(context_of(request).engine)
    if problem is not None:
        return ApiError(503, f"unhealthy: {problem}", type="unhealthy").response()
    return Response(status_code=200)


async def health_generate(request: Request) -> Response:
    """Healthy only if the engine can actually produce a token (SGLang's deep check)."""
    ctx = context_of(request)
    try:
        await asyncio.wait_for(ctx.engine.generate(input_ids=[0], max_new_tokens=1, temperature=0.0), 60)
    except Exception as exc:  # noqa: BLE001
        return ApiError(503, f"the engine failed to generate: {exc}", type="unhealthy").response()
    return Response(status_code=200)


def routes_spec() -> list[tuple[str, Any, list[str]]]:
    return [
        ("/generate", generate, ["POST", "PUT"]),
        ("/get_model_info", get_model_info, ["GET"]),
        ("/get_server_info", get_server_info, ["GET"]),
        ("/server_info", get_server_info, ["GET"]),
        ("/flush_cache", flush_cache, ["POST"]),  # changes state: never by GET
        ("/health", health, ["GET"]),
        ("/health_generate", health_generate, ["GET"]),
    ]


def _version() -> str:
    """The installed sgl's version (the backend does not import the product package)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sgl")
    except PackageNotFoundError:
        return "unknown"
