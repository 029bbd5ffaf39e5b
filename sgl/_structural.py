"""Grammars for tool calls and reasoning models, built as xgrammar structural tags.

    tool_choice="auto"       free text; after the format's trigger one call of a listed tool
                             (triggered tags: `<tool_call>` then exactly one tool's begin, its
                             arguments' schema, its end), then free text again
    tool_choice="required"   calls from the first token, separated by the format's separator
    tool_choice=<name>       exactly one call of that tool
    reasoning                any text without `</think>` (at most max_reasoning_tokens tokens:
                             xgrammar's any_text counts tokens and then allows only the end),
                             `</think>`, up to two newlines, then the constraint (or free text)

The structural tag is turned into EBNF text here and compiled by the engine as an ordinary
"ebnf" constraint, so the engine's compile cache, time limit and bitmask path serve it
unchanged: no backend hook. JSON inside is generated in the engine's fixed layout (no free
whitespace: a random-weight model cannot fill max_new_tokens with blanks), compact for tool
arguments, indented by 2 as `schema=` is elsewhere.

xgrammar is imported lazily (it imports torch); only requests that need these grammars pay it.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Sequence

from sgl._tool_format import ToolFormat
from sgl.errors import InvalidConstraintError
from sgl.reasoning import THINK_END, THINK_START
from sgl.tools import Tool, ToolChoice

__all__ = ["tool_format", "reasoning_format", "constraint_format", "to_ebnf"]

JSON_INDENT = 2  # the engine's layout for json_schema constraints (backend.grammar default)


def _json_grammar(schema: Any, indent: int | None) -> str:
    import xgrammar as xgr

    try:
        return str(xgr.Grammar.from_json_schema(json.dumps(schema) if not isinstance(schema, str) else schema,
                                                any_whitespace=False, indent=indent, strict_mode=True))
    except Exception as exc:  # noqa: BLE001 - xgrammar's own errors: the schema is at fault
        raise InvalidConstraintError(f"invalid JSON schema: {str(exc).splitlines()[0][:300]}",
                                     field="json_schema") from exc


def _tag(fmt: ToolFormat, tool: Tool) -> dict[str, Any]:
    return {"type": "tag", "begin": fmt.begin(tool.name),
            "content": {"type": "grammar", "grammar": _json_grammar(tool.parameters, None)},
            "end": fmt.end}


def tool_format(tools: Sequence[Tool], choice: ToolChoice, fmt: ToolFormat) -> dict[str, Any] | None:
    """The structural-tag format of a tool request, or None for tool_choice="none"."""
    if choice.mode == "none":
        return None
    if choice.mode == "named":
        tools = [t for t in tools if t.name == choice.name]
    tags = [_tag(fmt, t) for t in tools]
    if choice.mode == "auto":
        return {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags,
                "stop_after_first": not choice.parallel}
    return {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator, "at_least_one": True,
            "stop_after_first": choice.mode == "named" or not choice.parallel}


def constraint_format(kind: str, text: str) -> dict[str, Any]:
    """An engine constraint (kind, text) as a structural-tag format."""
    if kind == "regex":
        return {"type": "regex", "pattern": text}
    if kind == "json_schema":
        return {"type": "grammar", "grammar": _json_grammar(text, JSON_INDENT)}
    return {"type": "grammar", "grammar": text}


def reasoning_format(answer: dict[str, Any] | None, inside: bool, max_tokens: int | None) -> dict[str, Any]:
    """Reasoning first (opened here unless the prompt opened it), then `answer`."""
    think: dict[str, Any] = {"type": "any_text", "excludes": [THINK_END]}
    if max_tokens is not None:
        think["max_tokens"] = max_tokens
    elements: list[dict[str, Any]] = [] if inside else [{"type": "const_string", "value": THINK_START}]
    elements += [think, {"type": "const_string", "value": THINK_END},
                 {"type": "regex", "pattern": r"\n{0,2}"},
                 answer if answer is not None else {"type": "any_text"}]
    return {"type": "sequence", "elements": elements}


def to_ebnf(fmt: dict[str, Any]) -> str:
    """EBNF text of a structural-tag format (compiled by the engine as kind "ebnf"); cached,
    since an agent sends the same tools with every turn."""
    return _to_ebnf(json.dumps(fmt, sort_keys=True))


@functools.lru_cache(maxsize=256)
def _to_ebnf(fmt_json: str) -> str:
    import xgrammar as xgr

    try:
        return str(xgr.Grammar.from_structural_tag({"type": "structural_tag", "format": json.loads(fmt_json)}))
    except Exception as exc:  # noqa: BLE001
        raise InvalidConstraintError(f"cannot build the grammar: {str(exc).splitlines()[0][:300]}",
                                     field="tools") from exc
