"""Showing tools to the model: through its chat template when it renders tools, else ourselves.

A template that uses the `tools` variable (Qwen2.5/3, Llama 3.1, Hermes) gets the tools as
`apply_chat_template(..., tools=[...])` and renders earlier calls and results its own way.
A template without tool support (SmolLM2's) would silently drop them, so for those the tools
are described in the system message in the hermes format, and earlier assistant calls are
written into the assistant's content in that same format, results as the `tool` role's
content (the template renders any role name). The default format then is what the model was
shown, so a model that follows the prompt also follows the grammar.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from sgl._tool_format import ToolFormat

__all__ = ["template_renders_tools", "prepare_tool_messages", "with_tools"]


def template_renders_tools(chat_template: str | None) -> bool:
    return "tools" in (chat_template or "")


def _system_text(tools: Sequence[Mapping[str, Any]], fmt: ToolFormat) -> str:
    lines = [json.dumps(t["function"] if "function" in t else t, ensure_ascii=False) for t in tools]
    example = fmt.begin("<function-name>") + "<arguments-json-object>" + fmt.end
    return ("You can call functions. The functions, as JSON signatures:\n" + "\n".join(lines)
            + "\nTo call one, write exactly:\n" + example)


def _calls_text(calls: Any, fmt: ToolFormat) -> str:
    parts = []
    for call in calls or []:
        fn = call.get("function", call) if isinstance(call, Mapping) else {}
        args = fn.get("arguments", {})
        args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        parts.append(fmt.begin(str(fn.get("name", ""))) + args_text + fmt.end)
    return fmt.separator.join(parts)


def prepare_tool_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                          fmt: ToolFormat, renders_tools: bool) -> list[dict[str, Any]]:
    """The messages to hand a template that does not render tools (see the module docstring);
    unchanged (copies) for one that does."""
    out = [dict(m) for m in messages]
    if renders_tools:
        return out
    for m in out:
        calls = m.pop("tool_calls", None)
        if calls:
            text = _calls_text(calls, fmt)
            m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + text
    if tools:
        system = _system_text(tools, fmt)
        if out and out[0].get("role") == "system":
            out[0]["content"] = (out[0].get("content") or "") + "\n\n" + system
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def with_tools(tok: Any, messages: list[dict[str, Any]], tools: Sequence[Any] | None, fmt: ToolFormat,
               template_kwargs: Mapping[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, template variables) to render validated `messages` with `tools` (any form
    `normalize_tools` reads; checked here) for the tokenizer's template."""
    from sgl.tools import normalize_tools

    kwargs = dict(template_kwargs)
    specs = [t.openai() for t in normalize_tools(tools)] if tools is not None else None
    if specs is None and not any(m.get("tool_calls") for m in messages):
        return messages, kwargs
    renders = template_renders_tools(getattr(tok, "chat_template", None))
    messages = prepare_tool_messages(messages, specs, fmt, renders)
    if renders and specs is not None:
        kwargs["tools"] = specs
    return messages, kwargs
