"""sgl.Engine: the in-process engine, driven with async/await.

    async with sgl.Engine() as engine:              # the embedded default model
        out = await engine.generate("Hello", max_new_tokens=16, temperature=0)
        async for chunk in engine.stream("Tell me a story"):
            print(chunk.text, end="")

The engine computes on its own thread (sgl.backend.engine_loop); this module validates and
tokenizes requests on the caller's side, so bad input raises here, before anything is queued,
and hands results back to the caller's event loop. `generate_sync` / `stream_sync` are thin
wrappers for scripts and notebooks, running the async API on a private event loop thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import queue
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator, Mapping, Sequence, Union

from sgl._chat import check_messages, encode_chat, render_chat
from sgl._extras import Extras, OutputSplitter, compose, read_extras, take_extras, with_extras_params
from sgl._portal import LoopThread, SyncPortal, close_at_exit
from sgl._requests import (check_flag, check_kwarg_names, check_lengths, check_limits, check_min_tokens,
                           check_timeout, is_ids, is_messages, make_sink, split_prompts)
from sgl._spec import RequestSpec
from sgl.config import EngineConfig
from sgl.errors import (
    EngineClosedError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    ParseError,
)
from sgl.outputs import EngineStats, GenerateOutput, StreamChunk
from sgl.sampling import LogprobOptions, SamplingParams

if TYPE_CHECKING:
    from sgl.backend.runtime import Runtime

__all__ = ["Engine"]


def _close_parts(rt: Runtime, sync: SyncPortal) -> None:
    rt.close()  # first: running requests end ("abort") and reach their callers
    sync.close()

Message = Mapping[str, Any]
PromptInput = Union[str, Sequence[int], Sequence[Message]]

_CONSTRAINT_KEYS = ("schema", "grammar", "choices", "dtype")


@dataclass
class _Prepared:
    ids: list[int]
    params: SamplingParams
    constraint: Any  # sgl.constraints.ConstraintSpec or None: what the engine compiles
    parse_spec: Any = None  # the user's own constraint: what the answer is parsed with
    extras: Extras | None = None  # tools, reasoning, partial objects (sgl/_extras.py)

    def splitter(self) -> OutputSplitter | None:
        return OutputSplitter(self.extras) if self.extras is not None and self.extras.active else None


class Engine:
    """An LLM engine living in this process. See the module docstring."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        config = EngineConfig.from_kwargs(model, **{**EngineConfig.from_env_defaults(), **options})
        from sgl.backend.runtime import Runtime  # the one seam into the backend (torch lives there)

        self._rt: Runtime = Runtime(config)
        self.config: EngineConfig = self._rt.config
        self._closed = False
        self._sync = SyncPortal("sgl-sync")  # the loop behind generate_sync / stream_sync
        # A script that never calls close() still exits cleanly; an engine dropped unclosed
        # has its threads stopped (and its memory freed) when it is garbage-collected.
        self._finalizer = close_at_exit(self, functools.partial(_close_parts, self._rt, self._sync))

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the engine. Requests still running end with finish_reason "abort"."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        _close_parts(self._rt, self._sync)

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    @property
    def problem(self) -> str | None:
        """Why this engine cannot serve (closed, or its thread stopped after a crash), or None
        when it can: what a health check reports."""
        if self._closed:
            return "the engine is closed"
        return self._rt.problem()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- model and tokenizer -----------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self._rt.tokenizer

    @property
    def model_config(self) -> Any:
        return self._rt.model_config

    @property
    def context_length(self) -> int:
        return self._rt.context_length

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._need_tokenizer().encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._need_tokenizer().decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            tokenize: bool = False, tools: Sequence[Any] | None = None,
                            **template_kwargs: Any) -> str | list[int]:
        """The prompt of chat `messages` in the model's template: its text, or with
        `tokenize=True` its token ids, in which text inside the messages never becomes a
        control token (`encode()` of the text would turn a typed "<|im_start|>" into one).
        `tools` (any form `generate(tools=...)` takes) are rendered by the template when it
        supports them, else described in the system message (sgl/_tool_prompt.py);
        `template_kwargs` are the template's variables (e.g. enable_thinking=False)."""
        from sgl._tool_prompt import prepare_tool_messages, template_renders_tools
        from sgl.tools import normalize_tools

        tok = self._need_tokenizer()
        checked = check_messages(messages)
        kwargs = dict(template_kwargs)
        specs = [t.openai() for t in normalize_tools(tools)] if tools is not None else None
        if specs is not None or any(m.get("tool_calls") for m in checked):
            renders = template_renders_tools(getattr(tok, "chat_template", None))
            checked = prepare_tool_messages(checked, specs, self.tool_format(), renders)
            if renders and specs is not None:
                kwargs["tools"] = specs
        if tokenize:
            return encode_chat(tok, checked, add_generation_prompt, kwargs)
        return render_chat(tok, checked, add_generation_prompt, kwargs)

    def tool_format(self) -> Any:
        """How this model writes tool calls (sgl/_tool_format.py): from the engine option
        tool_call_parser, or read from the chat template."""
        from sgl._tool_format import detect_format

        tok = self._rt.tokenizer
        return detect_format(getattr(tok, "chat_template", None), self.config.tool_call_parser)

    def stats(self) -> EngineStats:
        return EngineStats(**self._rt.stats())

    def flush_cache(self) -> bool:
        """Drop the radix cache. Returns False (and does nothing) while requests run."""
        return self._rt.flush_cache()

    def check_integrity(self) -> None:
        """Assert that every KV slot is free, cached, or owned by exactly one running request."""
        self._rt.check_integrity()

    # -- generation --------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptInput | Sequence[PromptInput] | None = None,
        sampling_params: Mapping[str, Any] | SamplingParams | None = None,
        *,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        timeout: float | None = None,
        stream: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Generate for one prompt (-> GenerateOutput, or a list of n) or a list of prompts
        (-> a list, flattened over n). Prompts are text, token ids or chat messages.

        Keyword arguments are sampling parameters (SGLang names: max_new_tokens, temperature,
        top_p, stop, n, seed, regex, json_schema, ...) and the constraint front ends schema=,
        grammar=, choices=, dtype=. With stream=True an async iterator of chunks is returned.
        """
        check_flag("stream", stream)
        if stream:
            return self.stream(prompt, sampling_params, input_ids=input_ids, return_logprob=return_logprob,
                               logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                               timeout=timeout, **kwargs)
        check_timeout(timeout)
        prompts, single = split_prompts(prompt, input_ids)
        lp = LogprobOptions(return_logprob, logprob_start_len, top_logprobs_num)
        prepared = [self._prepare(p, sampling_params, kwargs, lp) for p in prompts]
        await self._compile_constraints(prepared)
        loop = asyncio.get_running_loop()
        rids: list[str] = []
        try:
            groups = []
            for p in prepared:
                groups.append(self._submit(p, lp, timeout, loop, stream_queue=None))
                rids.append(groups[-1][0])
            results = [await asyncio.gather(*futs) for _, futs in groups]
        except BaseException as exc:
            # Cancelled, or one prompt of a batch failed: stop the others instead of letting
            # them run on for nobody (their futures would also log "exception never retrieved").
            why = "cancelled by the caller" if isinstance(exc, asyncio.CancelledError) else (
                f"another prompt of the same generate() call failed: {exc!r}")
            for rid in rids:
                self._rt.abort(rid, why)
            for _, futs in groups:
                for fut in futs:
                    if fut.done() and not fut.cancelled():
                        fut.exception()  # mark retrieved
            raise
        outputs: list[GenerateOutput] = []
        for prep, outs in zip(prepared, results):
            for out in outs:
                splitter = prep.splitter()
                if splitter is not None:
                    splitter.split_output(out)
                self._parse(prep, out)
                outputs.append(out)
        if single:
            return outputs[0] if len(outputs) == 1 else outputs
        return outputs

    async def stream(
        self,
        prompt: PromptInput | None = None,
        sampling_params: Mapping[str, Any] | SamplingParams | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[StreamChunk]:
        """Stream one prompt: chunks whose `text` concatenates to the final text. With n > 1
        chunks of the samples interleave (`chunk.index`); the last chunk of each carries
        `finish_reason` and the full `output`."""
        prompts, single = split_prompts(prompt, input_ids)
        if not single or len(prompts) != 1:
            raise InvalidRequestError("stream() takes one prompt; call it once per prompt", field="prompt")
        check_timeout(timeout)
        lp = LogprobOptions(return_logprob, logprob_start_len, top_logprobs_num)
        prep = self._prepare(prompts[0], sampling_params, kwargs, lp)
        await self._compile_constraints([prep])
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        rid, futs = self._submit(prep, lp, timeout, loop, stream_queue=q)
        remaining = len(futs)
        splitters: dict[int, OutputSplitter | None] = {}
        try:
            while remaining:
                kind, payload = await q.get()
                if kind == "error":
                    raise payload
                if payload.index not in splitters:
                    splitters[payload.index] = prep.splitter()
                splitter = splitters[payload.index]
                if splitter is not None:
                    splitter.feed_chunk(payload)
                if payload.finish_reason is not None:
                    remaining -= 1
                    if payload.output is not None:
                        self._parse(prep, payload.output)
                yield payload
        finally:
            if remaining:
                self._rt.abort(rid, "stream closed by the caller")

    # -- sync wrappers -----------------------------------------------------------------------

    def generate_sync(self, *args: Any, **kwargs: Any) -> Any:
        """`generate` for code without an event loop (scripts, notebooks). Ctrl-C aborts the
        request and raises KeyboardInterrupt."""
        return self._blocking_portal().call(lambda: self.generate(*args, **kwargs))

    def stream_sync(self, *args: Any, **kwargs: Any) -> Iterator[StreamChunk]:
        """`stream` for code without an event loop: a plain iterator of chunks. Leaving the
        loop early (break, an exception, Ctrl-C) aborts the request."""
        q: queue.Queue[tuple[str, Any]] = queue.Queue()

        async def pump() -> None:
            try:
                async for chunk in self.stream(*args, **kwargs):
                    q.put(("chunk", chunk))
                q.put(("end", None))
            except asyncio.CancelledError:  # by the consumer (gone) or by close()
                q.put(("error", EngineClosedError("the engine was closed while streaming")))
                raise
            except BaseException as exc:  # handed to the consuming thread
                q.put(("error", exc))

        job = self._blocking_portal().start(pump)
        try:
            while True:
                try:
                    kind, payload = q.get(timeout=1.0)
                except queue.Empty:  # pump always says how it ended; unless its loop died
                    if job.done.is_set() and q.empty():
                        raise EngineClosedError("the engine's sync loop stopped") from None
                    continue
                if kind == "end":
                    return
                if kind == "error":
                    raise payload
                yield payload
        finally:
            job.cancel()  # a no-op once pump has finished; else it aborts the request

    def _blocking_portal(self) -> LoopThread:
        if self._closed:
            raise EngineClosedError("the engine is closed; create a new sgl.Engine")
        return self._sync.get()  # raises EngineClosedError too if close() won a race

    # -- request preparation (caller's thread; raises before anything is queued) -------------

    def _need_tokenizer(self) -> Any:
        if self._rt.tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer (dummy weights): send token ids",
                                      field="prompt")
        return self._rt.tokenizer

    def _tokenize(self, prompt: Any, extras: Extras | None = None) -> list[int]:
        if isinstance(prompt, str):
            ids = self.encode(prompt) if prompt else []
            if not ids:  # (a text of only characters the tokenizer drops, e.g. "\x04")
                raise InvalidRequestError("the prompt is empty (it has no tokens)", field="prompt")
            return ids
        if is_messages(prompt):
            if extras is not None:
                return list(self.apply_chat_template(prompt, tokenize=True, tools=extras.tools,
                                                     **extras.template_kwargs))
            return list(self.apply_chat_template(prompt, tokenize=True))
        if is_ids(prompt):
            ids = [int(t) for t in prompt]
            if not ids:
                raise InvalidRequestError("the prompt is empty", field="input_ids")
            vocab = self._rt.model_config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                                          field="input_ids")
            return ids
        if isinstance(prompt, Sequence) and len(prompt) == 0:
            raise InvalidRequestError("a prompt in the list is empty", field="prompt")
        raise InvalidRequestError(f"cannot read a prompt from {type(prompt).__name__}: pass text, token ids "
                                  "or chat messages", field="prompt")

    def _prepare(self, prompt: Any, sampling_params: Any, kwargs: dict[str, Any],
                 lp: LogprobOptions) -> _Prepared:
        if self._closed:
            raise EngineClosedError("the engine is closed; create a new sgl.Engine")
        kwargs = dict(kwargs)
        raw_extras = take_extras(kwargs)  # tools, reasoning options (sgl/_extras.py)
        check_kwarg_names(kwargs, _CONSTRAINT_KEYS)
        front = {k: kwargs.pop(k) for k in _CONSTRAINT_KEYS if k in kwargs}
        if kwargs.get("json_schema") is not None and not isinstance(kwargs["json_schema"], str):
            # A dict schema (issue 4 allows dict or JSON text): SamplingParams holds text only,
            # so the constraint front end normalises (or rejects) it.
            front["json_schema"] = kwargs.pop("json_schema")
        if sampling_params is None:
            params = SamplingParams.from_dict(kwargs)
        else:
            base = SamplingParams.from_dict(sampling_params).to_dict()
            base.update(kwargs)
            params = SamplingParams.from_dict(base)
        check_limits(params, lp, self.config)  # before any costly work (compiling, tokenizing)
        constraint = self._user_constraint(params, front)
        if constraint is not None:
            params = with_extras_params(params, constraint)
            check_min_tokens(params, constraint.kind, constraint.spec, constraint.source)
            # compiled (and rejected if invalid) by _compile_constraints, off the event loop
        vocab = self._rt.model_config.vocab_size
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise InvalidSamplingParamsError(f"stop_token_ids {bad_stop[:5]} are outside the vocabulary "
                                             f"[0, {vocab})", field="stop_token_ids")
        extras = None
        if raw_extras or front.get("schema") is not None or self._reasoning_possible():
            extras = read_extras(raw_extras, self.tool_format(), front.get("schema"))
        ids = self._tokenize(prompt, extras)
        parse_spec = constraint
        if extras is not None:
            extras.reasoning = self._reasoning_mode(ids, extras)
            constraint = compose(extras, constraint, self._limits())
            params = with_extras_params(params, constraint)
        check_lengths(len(ids), params, lp, self._rt.context_length, self._rt.config.max_total_tokens)
        return _Prepared(ids, params, constraint, parse_spec, extras)

    def _limits(self) -> Any:
        from sgl.constraints import ConstraintLimits

        return ConstraintLimits(self.config.max_grammar_bytes, self.config.max_json_schema_depth)

    def _user_constraint(self, params: SamplingParams, front: dict[str, Any]) -> Any:
        """The constraint of schema= / regex= / json_schema= / grammar= / ... (or None);
        size and depth checked against the engine's limits."""
        if not front and params.constraint is None:
            return None
        from sgl.constraints import build_constraint

        spec = {k: getattr(params, k) for k in ("regex", "json_schema") if getattr(params, k) is not None}
        if params.ebnf is not None:
            spec["grammar"] = params.ebnf
        return build_constraint(**spec, **front, limits=self._limits())

    def _reasoning_possible(self) -> bool:
        parser = self.config.reasoning_parser
        template = getattr(self._rt.tokenizer, "chat_template", None) or ""
        return parser != "none" and (parser != "auto" or "<think>" in template)

    def _reasoning_mode(self, ids: list[int], extras: Extras) -> Any:
        """How this prompt's output is split (None: not at all), read from the prompt's end."""
        from sgl.reasoning import reasoning_mode

        mode = None
        tok = self._rt.tokenizer
        if extras.separate_reasoning and tok is not None and self._reasoning_possible():
            tail = tok.decode(ids[-16:])
            mode = reasoning_mode(self.config.reasoning_parser, getattr(tok, "chat_template", None), tail)
        if mode is None and extras.max_reasoning_tokens is not None:
            raise InvalidRequestError("max_reasoning_tokens needs a reasoning model (a chat template that "
                                      "writes <think>, or the engine option reasoning_parser) and "
                                      "separate_reasoning=True", field="max_reasoning_tokens")
        return mode

    async def _compile_constraints(self, prepared: Sequence[_Prepared]) -> None:
        """Compile each request's constraint on the grammar workers, awaited, so that a slow
        grammar delays only its own request; InvalidConstraintError if it is invalid or takes
        longer than grammar_compile_timeout. The result rides on the spec until `_submit`."""
        for prep in prepared:
            spec = prep.constraint
            if spec is not None and spec.compiled is None:
                compiled = await self._rt.compile_constraint(spec.kind, spec.spec)
                prep.constraint = dataclasses.replace(spec, compiled=compiled)

    def _submit(self, prep: _Prepared, lp: LogprobOptions, timeout: float | None,
                loop: asyncio.AbstractEventLoop, stream_queue: asyncio.Queue | None):
        futs: list[asyncio.Future[GenerateOutput]] = [loop.create_future() for _ in range(prep.params.n)]
        spec = RequestSpec(prompt_ids=prep.ids, params=prep.params, logprob=lp,
                           sinks=[make_sink(loop, fut, stream_queue) for fut in futs],
                           stream=stream_queue is not None, timeout=timeout,
                           constraint=prep.constraint.compiled if prep.constraint is not None else None)
        return self._rt.submit(spec), futs

    @staticmethod
    def _parse(prep: _Prepared, out: GenerateOutput) -> None:
        spec = prep.parse_spec
        if spec is None or out.finish_reason == "abort":
            return
        text = out.content if out.content is not None else out.text  # the answer after any reasoning
        try:
            out.parsed_value = spec.parse(text, finish_reason=out.finish_reason)
        except ParseError as exc:
            # Not raised here: with a batch or n > 1 that would lose the other outputs. Reading
            # `out.parsed` raises it.
            exc.output = out  # type: ignore[attr-defined]
            out.parse_error = exc
