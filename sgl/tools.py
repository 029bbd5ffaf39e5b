"""Tools a model may call: what the user passes as `tools=` and `tool_choice=`, normalised.

A tool is given as any of
- an OpenAI function dict: `{"type": "function", "function": {"name", "description", "parameters"}}`
  (or the inner `{"name", "description", "parameters"}` alone);
- a Pydantic model class: its name is the tool's name, its docstring the description, its fields
  the arguments; calls come back with the validated instance (`ToolCall.value`);
- a plain Python function with type hints: its parameters become a Pydantic model (so calls come
  back validated too) and `Tool.fn` keeps the function, for `Tool.invoke`.

`tool_choice` is "auto" (the model may answer or call), "required" (it must call at least one),
"none" (it must not call; the tools are still shown to it), or one tool's name (given as the
name, or OpenAI's `{"type": "function", "function": {"name": ...}}`): exactly one call of it.

How calls are written (the format) and how the grammar forces them: `sgl._tool_format` and
`sgl._structural`. This module is pure Python; pydantic is imported lazily.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

from sgl.errors import InvalidRequestError

__all__ = ["Tool", "ToolChoice", "normalize_tools", "normalize_tool_choice", "MAX_TOOLS"]

MAX_TOOLS = 128  # tools per request: each one adds a branch to the compiled grammar
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")

ToolMode = Literal["auto", "required", "none", "named"]


@dataclass(frozen=True)
class Tool:
    """One callable tool: a name, a description and the JSON schema of its arguments."""

    name: str
    parameters: dict[str, Any]
    description: str = ""
    model: Any = field(default=None, compare=False, repr=False)  # Pydantic model of the arguments
    fn: Callable[..., Any] | None = field(default=None, compare=False, repr=False)

    def openai(self) -> dict[str, Any]:
        """The OpenAI function dict (what chat templates render, what the server reports)."""
        spec: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            spec["description"] = self.description
        return {"type": "function", "function": spec}

    def validate(self, arguments: Mapping[str, Any]) -> Any:
        """The arguments as the tool's Pydantic model (None when the tool has no model)."""
        return None if self.model is None else self.model.model_validate(dict(arguments))

    def invoke(self, arguments: Mapping[str, Any]) -> Any:
        """Call the Python function behind a function tool with validated arguments."""
        if self.fn is None:
            raise TypeError(f"tool {self.name!r} was not given as a Python function")
        value = self.validate(arguments)
        return self.fn(**{name: getattr(value, name) for name in type(value).model_fields})


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolMode
    name: str | None = None  # with mode "named"
    parallel: bool = True  # more than one call allowed (OpenAI's parallel_tool_calls)


def normalize_tools(tools: Any, field_name: str = "tools") -> list[Tool]:
    """A validated list of Tool; InvalidRequestError naming the entry at fault."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence) or not tools:
        raise InvalidRequestError(f"{field_name} must be a non-empty list of tools (OpenAI function dicts, "
                                  "Pydantic models or Python functions)", field=field_name)
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"{field_name} has {len(tools)} tools, over the limit of {MAX_TOOLS}",
                                  field=field_name)
    out = [_one_tool(t, f"{field_name}[{i}]") for i, t in enumerate(tools)]
    seen: set[str] = set()
    for i, tool in enumerate(out):
        if tool.name in seen:
            raise InvalidRequestError(f"{field_name}[{i}]: the tool name {tool.name!r} is used twice; "
                                      "names must be unique", field=field_name)
        seen.add(tool.name)
    return out


def _check_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not name or len(name) > 64 or not set(name) <= _NAME_CHARS:
        raise InvalidRequestError(f"{where}: a tool name must be 1-64 characters of a-z, A-Z, 0-9, _ "
                                  f"and -, got {json.dumps(name)[:70] if _jsonable(name) else type(name).__name__}",
                                  field=where.split("[")[0])
    return name


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _one_tool(tool: Any, where: str) -> Tool:
    if isinstance(tool, Tool):
        return tool
    if isinstance(tool, Mapping):
        return _from_dict(tool, where)
    if isinstance(tool, type) and hasattr(tool, "model_json_schema"):
        schema = tool.model_json_schema()
        doc = inspect.getdoc(tool) or ""
        return Tool(_check_name(tool.__name__, where), schema, doc, model=tool)
    if inspect.isfunction(tool) or inspect.ismethod(tool):
        return _from_function(tool, where)
    raise InvalidRequestError(f"{where}: cannot read a tool from {type(tool).__name__}; pass an OpenAI "
                              "function dict, a Pydantic model class or a Python function",
                              field=where.split("[")[0])


def _from_dict(tool: Mapping[str, Any], where: str) -> Tool:
    spec: Any = tool
    if "function" in tool or tool.get("type") is not None:
        if tool.get("type") != "function" or not isinstance(tool.get("function"), Mapping):
            raise InvalidRequestError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}",
                                      field=where.split("[")[0])
        spec = tool["function"]
    name = _check_name(spec.get("name"), f"{where}.function.name" if spec is not tool else f"{where}.name")
    params = spec.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, Mapping) or params.get("type", "object") != "object":
        raise InvalidRequestError(f"{where}: parameters must be a JSON schema of type object",
                                  field=where.split("[")[0])
    desc = spec.get("description") or ""
    if not isinstance(desc, str):
        raise InvalidRequestError(f"{where}: description must be a string", field=where.split("[")[0])
    return Tool(name, dict(params), desc)


def _from_function(fn: Callable[..., Any], where: str) -> Tool:
    """A Pydantic model of the function's parameters (hints required: they are the schema)."""
    import pydantic

    fields: dict[str, Any] = {}
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise InvalidRequestError(f"{where}: function {fn.__name__} takes *args/**kwargs; tools need "
                                      "named parameters", field=where.split("[")[0])
        if param.annotation is inspect.Parameter.empty:
            raise InvalidRequestError(f"{where}: parameter {pname!r} of {fn.__name__} has no type hint; "
                                      "tools need hints (they become the JSON schema)", field=where.split("[")[0])
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[pname] = (param.annotation, default)
    hints = inspect.get_annotations(fn, eval_str=True)  # resolve `from __future__` string hints
    fields = {k: (hints.get(k, t), d) for k, (t, d) in fields.items()}
    model = pydantic.create_model(fn.__name__, __doc__=inspect.getdoc(fn), **fields)
    return Tool(_check_name(fn.__name__, where), model.model_json_schema(), inspect.getdoc(fn) or "",
                model=model, fn=fn)


def normalize_tool_choice(choice: Any, tools: Sequence[Tool], parallel: Any = True,
                          field_name: str = "tool_choice") -> ToolChoice:
    if not isinstance(parallel, bool):
        raise InvalidRequestError(f"parallel_tool_calls must be true or false, got {parallel!r}",
                                  field="parallel_tool_calls")
    if choice is None:
        choice = "auto"
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError(f"{field_name} must be 'auto', 'required', 'none' or "
                                      "{\"type\": \"function\", \"function\": {\"name\": ...}}", field=field_name)
        choice = fn["name"]
    elif isinstance(choice, type) or inspect.isfunction(choice):
        choice = getattr(choice, "__name__", "")
    if not isinstance(choice, str):
        raise InvalidRequestError(f"{field_name} must be 'auto', 'required', 'none' or a tool's name",
                                  field=field_name)
    if choice in ("auto", "required", "none"):
        return ToolChoice(choice, None, parallel)  # type: ignore[arg-type]
    names = [t.name for t in tools]
    if choice not in names:
        raise InvalidRequestError(f"{field_name} names the function {choice[:64]!r}, which is not among the "
                                  f"tools {names[:20]}", field=field_name)
    return ToolChoice("named", choice, False)
