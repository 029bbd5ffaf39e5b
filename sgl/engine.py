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
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator, Mapping, Sequence, Union

from sgl._chat import check_messages, encode_chat, render_chat
from sgl._extras import OutputSplitter
from sgl._prepare import Prepared, finish_output, parse_output, prepare
from sgl._portal import LoopThread, SyncPortal, close_at_exit
from sgl._requests import check_flag, check_timeout, make_sink, split_prompts
from sgl._spec import RequestSpec
from sgl.config import EngineConfig
from sgl.errors import EngineClosedError, InvalidRequestError
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
        from sgl._tool_prompt import with_tools

        tok = self._need_tokenizer()
        checked, kwargs = with_tools(tok, check_messages(messages), tools, self.tool_format(), template_kwargs)
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

        Also tools=, tool_choice=, parallel_tool_calls= (-> output.tool_calls), and for thinking
        models separate_reasoning=, max_reasoning_tokens=, chat_template_kwargs= (sgl/_extras.py).
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
                finish_output(prep, out)  # reasoning / content / tool calls, then the parsed value
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

    def _prepare(self, prompt: Any, sampling_params: Any, kwargs: dict[str, Any],
                 lp: LogprobOptions) -> Prepared:
        if self._closed:
            raise EngineClosedError("the engine is closed; create a new sgl.Engine")
        return prepare(self, prompt, sampling_params, kwargs, lp)

    async def _compile_constraints(self, prepared: Sequence[Prepared]) -> None:
        """Compile each request's constraint on the grammar workers, awaited, so that a slow
        grammar delays only its own request; InvalidConstraintError if it is invalid or takes
        longer than grammar_compile_timeout. The result rides on the spec until `_submit`."""
        for prep in prepared:
            spec = prep.constraint
            if spec is not None and spec.compiled is None:
                compiled = await self._rt.compile_constraint(spec.kind, spec.spec)
                prep.constraint = dataclasses.replace(spec, compiled=compiled)

    def _submit(self, prep: Prepared, lp: LogprobOptions, timeout: float | None,
                loop: asyncio.AbstractEventLoop, stream_queue: asyncio.Queue | None):
        futs: list[asyncio.Future[GenerateOutput]] = [loop.create_future() for _ in range(prep.params.n)]
        spec = RequestSpec(prompt_ids=prep.ids, params=prep.params, logprob=lp,
                           sinks=[make_sink(loop, fut, stream_queue) for fut in futs],
                           stream=stream_queue is not None, timeout=timeout,
                           constraint=prep.constraint.compiled if prep.constraint is not None else None)
        return self._rt.submit(spec), futs

    @staticmethod
    def _parse(prep: Prepared, out: GenerateOutput) -> None:
        parse_output(prep, out)
