"""Preparing one prompt's request for `sgl.Engine`, on the caller's thread: sampling params,
the constraint (the user's own, or the grammar of tools and reasoning around it: sgl._extras),
tokenization (chat messages rendered with the request's tools), and, once it has run, parsing
the answer. Everything here raises before anything is queued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from sgl._extras import (Extras, OutputSplitter, compose, read_extras, reasoning_possible, request_reasoning,
                         take_extras, user_constraint, with_extras_params)
from sgl._requests import (check_kwarg_names, check_lengths, check_limits, check_min_tokens, check_vocab, is_ids,
                           is_messages)
from sgl.errors import InvalidRequestError, ParseError
from sgl.outputs import GenerateOutput
from sgl.sampling import LogprobOptions, SamplingParams

__all__ = ["Prepared", "prepare", "tokenize", "parse_output", "finish_output", "CONSTRAINT_KEYS"]

CONSTRAINT_KEYS = ("schema", "grammar", "choices", "dtype")


@dataclass
class Prepared:
    ids: list[int]
    params: SamplingParams
    constraint: Any  # sgl.constraints.ConstraintSpec or None: what the engine compiles
    parse_spec: Any = None  # the user's own constraint: what the answer is parsed with
    extras: Extras | None = None  # tools, reasoning, partial objects (sgl/_extras.py)

    def splitter(self) -> OutputSplitter | None:
        return OutputSplitter(self.extras) if self.extras is not None and self.extras.active else None


def tokenize(engine: Any, prompt: Any, extras: Extras | None = None) -> list[int]:
    """Token ids of a text, token-id or chat-messages prompt (InvalidRequestError if empty or
    out of the vocabulary); chat messages are rendered with the request's tools."""
    if isinstance(prompt, str):
        ids = engine.encode(prompt) if prompt else []
        if not ids:  # (a text of only characters the tokenizer drops, e.g. "\x04")
            raise InvalidRequestError("the prompt is empty (it has no tokens)", field="prompt")
        return ids
    if is_messages(prompt):
        if extras is not None:
            return list(engine.apply_chat_template(prompt, tokenize=True, tools=extras.tools,
                                                 **extras.template_kwargs))
        return list(engine.apply_chat_template(prompt, tokenize=True))
    if is_ids(prompt):
        ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("the prompt is empty", field="input_ids")
        vocab = engine._rt.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                                      field="input_ids")
        return ids
    if isinstance(prompt, Sequence) and len(prompt) == 0:
        raise InvalidRequestError("a prompt in the list is empty", field="prompt")
    raise InvalidRequestError(f"cannot read a prompt from {type(prompt).__name__}: pass text, token ids "
                              "or chat messages", field="prompt")

def prepare(engine: Any, prompt: Any, sampling_params: Any, kwargs: dict[str, Any],
            lp: LogprobOptions) -> Prepared:
    """Validate, build the constraint and tokenize one prompt's request (see the module
    docstring); raises before anything is queued."""
    kwargs = dict(kwargs)
    raw_extras = take_extras(kwargs)  # tools, reasoning options (sgl/_extras.py)
    check_kwarg_names(kwargs, CONSTRAINT_KEYS)
    front = {k: kwargs.pop(k) for k in CONSTRAINT_KEYS if k in kwargs}
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
    check_limits(params, lp, engine.config)  # before any costly work (compiling, tokenizing)
    constraint = user_constraint(params, front, _limits(engine))
    if constraint is not None:
        params = with_extras_params(params, constraint)
        check_min_tokens(params, constraint.kind, constraint.spec, constraint.source)
        # compiled (and rejected if invalid) by _compile_constraints, off the event loop
    check_vocab(params, engine._rt.model_config.vocab_size)
    extras = None
    thinking = reasoning_possible(engine.config.reasoning_parser, engine.tokenizer)
    if raw_extras or front.get("schema") is not None or thinking:
        extras = read_extras(raw_extras, engine.tool_format(), front.get("schema"))
        extras.chat_prompt = extras.chat_prompt or is_messages(prompt)
    ids = tokenize(engine, prompt, extras)
    parse_spec = constraint
    if extras is not None:
        extras.reasoning = request_reasoning(extras, engine.config.reasoning_parser, engine.tokenizer, ids)
        constraint = compose(extras, constraint, _limits(engine))
        params = with_extras_params(params, constraint)
    check_lengths(len(ids), params, lp, engine._rt.context_length, engine._rt.config.max_total_tokens)
    return Prepared(ids, params, constraint, parse_spec, extras)


def _limits(engine: Any) -> Any:
    from sgl.constraints import ConstraintLimits

    return ConstraintLimits(engine.config.max_grammar_bytes, engine.config.max_json_schema_depth)


def parse_output(prep: Prepared, out: GenerateOutput) -> None:
    """Set `out.parsed_value` (or `parse_error`) from the answer: the content after any
    reasoning when the output was split."""
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


def finish_output(prep: Prepared, out: GenerateOutput) -> None:
    """A non-streamed output: split it (reasoning, content, tool calls), then parse it."""
    splitter = prep.splitter()
    if splitter is not None:
        splitter.split_output(out)
    parse_output(prep, out)
