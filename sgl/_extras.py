"""A request's extras beyond sampling: tools, reasoning, partial objects (see `sgl.Engine`).

    generate(messages, tools=[...], tool_choice="auto"|"required"|"none"|name, parallel_tool_calls=True)
    generate(messages, schema=Answer, max_reasoning_tokens=256, separate_reasoning=True)
    stream(prompt, schema=Answer)          # chunks carry .partial

`read_extras` validates the options (before anything is queued), `compose` turns the tools and
the reasoning mode, together with the user's own constraint, into the one grammar the engine
compiles, and `OutputSplitter` splits each sample's text into reasoning, content and tool
calls, incrementally for streams and at once for final outputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from sgl._tool_format import ToolCallParser, ToolFormat
from sgl.constraints import ConstraintLimits, ConstraintSpec
from sgl.errors import InvalidRequestError
from sgl.outputs import GenerateOutput, StreamChunk
from sgl.reasoning import ReasoningMode, ReasoningSplitter
from sgl.tools import Tool, ToolChoice, normalize_tool_choice, normalize_tools

__all__ = ["EXTRA_KEYS", "Extras", "take_extras", "read_extras", "compose", "OutputSplitter", "user_constraint",
           "reasoning_possible", "request_reasoning", "with_extras_params"]

EXTRA_KEYS = ("tools", "tool_choice", "parallel_tool_calls", "separate_reasoning", "max_reasoning_tokens",
              "chat_template_kwargs")


@dataclass
class Extras:
    tools: list[Tool] | None = None
    choice: ToolChoice | None = None
    fmt: ToolFormat | None = None
    separate_reasoning: bool = True
    # True when the caller said separate_reasoning=True: a text or token-id prompt is then
    # read as a rendered chat prompt (the server's chat route does this); by default only chat
    # messages, or a prompt that itself opens <think>, are.
    chat_prompt: bool = False
    max_reasoning_tokens: int | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    partial_model: Any = None  # a Pydantic model given as schema=
    reasoning: ReasoningMode | None = None  # set per prompt, once it is rendered

    @property
    def parses_tools(self) -> bool:
        return self.tools is not None and self.choice is not None and self.choice.mode != "none"

    @property
    def active(self) -> bool:
        return self.parses_tools or self.reasoning is not None or self.partial_model is not None


def take_extras(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop the extras' keyword arguments out of generate()'s kwargs."""
    return {k: kwargs.pop(k) for k in EXTRA_KEYS if k in kwargs}


def _flag(raw: Mapping[str, Any], name: str, default: bool) -> bool:
    value = raw.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be True or False, got {value!r}", field=name)
    return value


def read_extras(raw: Mapping[str, Any], fmt: ToolFormat, schema: Any) -> Extras:
    """Validated extras (InvalidRequestError naming the field at fault)."""
    extras = Extras(fmt=fmt, separate_reasoning=_flag(raw, "separate_reasoning", True),
                    chat_prompt=raw.get("separate_reasoning") is True)
    tools = raw.get("tools")
    if tools is not None:
        extras.tools = normalize_tools(tools)
        extras.choice = normalize_tool_choice(raw.get("tool_choice"), extras.tools,
                                              _flag(raw, "parallel_tool_calls", True))
    elif raw.get("tool_choice") not in (None, "none", "auto"):
        raise InvalidRequestError("tool_choice needs tools=[...]", field="tool_choice")
    cap = raw.get("max_reasoning_tokens")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        raise InvalidRequestError(f"max_reasoning_tokens must be an integer >= 0, got {cap!r}",
                                  field="max_reasoning_tokens")
    extras.max_reasoning_tokens = cap
    kwargs = raw.get("chat_template_kwargs")
    if kwargs is not None and (not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs)):
        raise InvalidRequestError("chat_template_kwargs must be a dict of template variables",
                                  field="chat_template_kwargs")
    extras.template_kwargs = dict(kwargs or {})
    if isinstance(schema, type) and hasattr(schema, "model_fields"):
        extras.partial_model = schema
    return extras


def user_constraint(params: Any, front: Mapping[str, Any], limits: ConstraintLimits) -> ConstraintSpec | None:
    """The constraint of schema= / regex= / json_schema= / grammar= / ... (or None); size and
    depth checked against the engine's limits."""
    if not front and params.constraint is None:
        return None
    from sgl.constraints import build_constraint

    spec = {k: getattr(params, k) for k in ("regex", "json_schema") if getattr(params, k) is not None}
    if params.ebnf is not None:
        spec["grammar"] = params.ebnf
    return build_constraint(**spec, **front, limits=limits)


def reasoning_possible(parser: str, tok: Any) -> bool:
    """Whether any request can be a reasoning one (engine option reasoning_parser, template)."""
    template = getattr(tok, "chat_template", None) or ""
    return parser != "none" and (parser != "auto" or "<think>" in template)


def request_reasoning(extras: Extras, parser: str, tok: Any, ids: list[int]) -> ReasoningMode | None:
    """How this prompt's output is split (None: not at all), read from the prompt's end."""
    from sgl.reasoning import reasoning_mode

    mode = None
    if extras.separate_reasoning and tok is not None and reasoning_possible(parser, tok):
        mode = reasoning_mode(parser, getattr(tok, "chat_template", None), tok.decode(ids[-16:]))
        if mode is not None and not mode.inside and not extras.chat_prompt:
            mode = None  # a plain completion prompt: the model is not expected to open <think>
    if mode is None and extras.max_reasoning_tokens is not None:
        raise InvalidRequestError("max_reasoning_tokens needs a reasoning model (a chat template that writes "
                                  "<think>, or the engine option reasoning_parser) and separate_reasoning=True",
                                  field="max_reasoning_tokens")
    return mode


def compose(extras: Extras, constraint: ConstraintSpec | None, limits: ConstraintLimits) -> ConstraintSpec | None:
    """The grammar the engine compiles: the user's constraint alone, or a structural tag of
    the tool calls and/or the reasoning around it (as EBNF)."""
    from sgl import _structural

    if extras.parses_tools and constraint is not None:
        mode = extras.choice.mode  # type: ignore[union-attr]
        raise InvalidRequestError(f"tools with tool_choice={mode!r} cannot be combined with "
                                  f"{constraint.source}: the tool grammar already constrains the output; "
                                  "pass tool_choice='none' to use the constraint", field="tools")
    answer = None
    if extras.parses_tools:
        answer = _structural.tool_format(extras.tools or [], extras.choice, extras.fmt)  # type: ignore[arg-type]
    elif constraint is not None:
        answer = None if extras.reasoning is None else _structural.constraint_format(constraint.kind, constraint.text)
    reasoning = extras.reasoning
    if reasoning is not None and (answer is not None or extras.max_reasoning_tokens is not None):
        fmt = _structural.reasoning_format(answer, reasoning.inside, extras.max_reasoning_tokens)
    elif answer is not None:
        fmt = answer
    else:
        return constraint
    if extras.parses_tools:  # what the user sent; the EBNF built from it is larger by a fixed factor
        limits.check_size(json.dumps([t.parameters for t in extras.tools or []]), "the tools' parameter schemas",
                          "tools")
    text = _structural.to_ebnf(fmt)
    source = "tool calls" if extras.parses_tools else (constraint.source if constraint else "reasoning")
    return ConstraintSpec("ebnf", text, source=source)


class OutputSplitter:
    """One sample's text -> reasoning, content, tool calls (and partial objects)."""

    def __init__(self, extras: Extras) -> None:
        self.extras = extras
        self.reasoner = ReasoningSplitter(extras.reasoning) if extras.reasoning is not None else None
        parses = extras.parses_tools and extras.fmt is not None
        self.tools = ToolCallParser(extras.fmt, extras.tools or []) if parses else None  # type: ignore[arg-type]
        self._content: list[str] = []
        self._partial_text = ""

    def _route(self, reasoning: str, content: str, chunk: StreamChunk | None) -> None:
        deltas: list[Any] = []
        if self.tools is not None and content:
            content, deltas = self.tools.feed(content)
        self._content.append(content)
        if chunk is not None:
            if self.reasoner is not None:
                chunk.reasoning = (chunk.reasoning or "") + reasoning
            chunk.content = (chunk.content or "") + content
            if self.tools is not None:
                chunk.tool_calls = (chunk.tool_calls or []) + deltas

    def feed_chunk(self, chunk: StreamChunk) -> None:
        """Fill the chunk's reasoning / content / tool_calls / partial from its text."""
        chunk.content = ""
        reasoning, content = self.reasoner.feed(chunk.text) if self.reasoner is not None else ("", chunk.text)
        self._route(reasoning, content, chunk)
        if chunk.finish_reason is not None:
            self._flush(chunk)
        if self.extras.partial_model is not None:
            from sgl.partial import parse_partial

            self._partial_text += chunk.content
            chunk.partial = parse_partial(self._partial_text, self.extras.partial_model)
        if chunk.output is not None:
            self.finish(chunk.output)

    def _flush(self, chunk: StreamChunk | None) -> None:
        """At the end of the sample: what the splitters held back."""
        if self.reasoner is not None:
            reasoning, content = self.reasoner.flush()
            self._route(reasoning, content, chunk)
        if self.tools is not None:
            rest = self.tools.flush()
            self._content.append(rest)
            if chunk is not None:
                chunk.content = (chunk.content or "") + rest

    def finish(self, out: GenerateOutput) -> None:
        """Set the output's reasoning / content / tool_calls (after the last feed)."""
        if self.reasoner is not None and self.extras.separate_reasoning:
            out.reasoning = "".join(self.reasoner.reasoning).strip()
        if self.tools is not None:
            content, calls = self.tools.result()
            out.tool_calls = calls
            out.content = content.strip() if calls else content
        elif self.reasoner is not None:
            out.content = "".join(self._content)

    def split_output(self, out: GenerateOutput) -> None:
        """The whole text at once (non-streamed outputs)."""
        reasoning, content = self.reasoner.feed(out.text) if self.reasoner is not None else ("", out.text)
        self._route(reasoning, content, None)
        self._flush(None)
        self.finish(out)


def with_extras_params(params: Any, spec: ConstraintSpec | None) -> Any:
    """SamplingParams carrying `spec` as its one constraint field."""
    cleared = params.replace(regex=None, json_schema=None, ebnf=None)
    return cleared if spec is None else cleared.replace(**{spec.kind: spec.spec})

