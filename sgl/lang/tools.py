"""Tool calls in programs: `sgl.tool_call(name, tools=[...])` and `sgl.tools_prompt(tools)`.

    @sgl.function
    def agent(s, question):
        s += sgl.system(sgl.tools_prompt([add, convert]))
        s += sgl.user(question)
        s += sgl.assistant(sgl.tool_call("call", tools=[add, convert]))
        call = s["call"][0]                     # a ToolCall: name, arguments, value (validated)

`tool_call` is a gen whose grammar (built as in `Engine.generate(tools=...)`, sgl._structural)
forces one call (or several with parallel_tool_calls=True) of the given tools, written in the
hermes format unless `format="llama3"`; the variable holds the list of `ToolCall`s parsed from
it, the state's text the call as written. `tools_prompt` is the instruction text that shows
the model the tools and the format (what the engine adds for templates without tool support).
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

from sgl.lang.ir import GenOptions, SglGen
from sgl.outputs import ToolCall

__all__ = ["tool_call", "tools_prompt", "SglToolCall"]


class SglToolCall(SglGen):
    """A gen constrained to tool calls; its variable is the list of parsed calls."""

    def __init__(self, name: str | None, options: GenOptions, tools: list[Any], fmt: Any) -> None:
        super().__init__(name, options)
        self.tools, self.fmt = tools, fmt

    def parse(self, text: str) -> list[ToolCall]:
        from sgl._tool_format import ToolCallParser

        parser = ToolCallParser(self.fmt, self.tools)
        parser.feed(text)
        parser.flush()
        return parser.result()[1]


def tool_call(name: str | None = None, tools: Sequence[Any] = (), tool_choice: Any = "required",
              parallel_tool_calls: bool = False, format: Literal["hermes", "llama3"] = "hermes",
              max_tokens: int | None = None, temperature: float | None = None, **sampling: Any) -> SglToolCall:
    """Generate tool calls of `tools` (Pydantic models, OpenAI function dicts or typed Python
    functions) into variable `name`. tool_choice: "required" or a tool's name ("auto" and
    "none" make no sense for a primitive whose whole output is calls)."""
    from sgl import _structural
    from sgl._tool_format import FORMATS
    from sgl.errors import InvalidRequestError
    from sgl.tools import normalize_tool_choice, normalize_tools

    normalized = normalize_tools(tools)
    choice = normalize_tool_choice(tool_choice, normalized, parallel_tool_calls)
    if choice.mode in ("auto", "none"):
        raise InvalidRequestError("tool_call() needs tool_choice='required' or a tool's name; for free text "
                                  "use gen()", field="tool_choice")
    fmt = FORMATS[format]
    grammar = _structural.to_ebnf(_structural.tool_format(normalized, choice, fmt))  # type: ignore[arg-type]
    options = GenOptions(max_new_tokens=max_tokens, temperature=temperature, grammar=grammar, extra=dict(sampling))
    return SglToolCall(name, options, normalized, fmt)


def tools_prompt(tools: Sequence[Any], format: Literal["hermes", "llama3"] = "hermes") -> str:
    """Instructions that show the model `tools` and how to call them."""
    from sgl._tool_format import FORMATS
    from sgl._tool_prompt import prepare_tool_messages
    from sgl.tools import normalize_tools

    specs = [t.openai() for t in normalize_tools(tools)]
    return str(prepare_tool_messages([], specs, FORMATS[format], renders_tools=False)[0]["content"])
