"""How a model writes a tool call, and reading calls back out of its text, incrementally.

Two formats, picked from the chat template (`detect_format`):

    hermes  (Qwen2.5/Qwen3, Hermes; the default)   <tool_call>
                                                    {"name": "add", "arguments": {"a": 1}}
                                                    </tool_call>
    llama3  (Llama 3.1+ JSON tool calling)          {"name": "add", "parameters": {"a": 1}}

A template that renders tools itself shows which one it teaches the model; a template without
tool support (SmolLM2's) gets hermes, with the tools described in a system message (see
`sgl._tool_prompt`). The grammar (`sgl._structural`) forces each call to be exactly
`format.begin(name) + <arguments JSON> + format.end`, so the parser below can be exact: it
finds the trigger, matches one tool's `begin`, then scans the arguments object with a JSON
scanner (strings, escapes, nesting), and needs no guessing about where a call ends.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from sgl.outputs import ToolCall, ToolCallDelta
from sgl.tools import Tool

__all__ = ["ToolFormat", "FORMATS", "detect_format", "ToolCallParser"]


@dataclass(frozen=True)
class ToolFormat:
    name: str
    trigger: str  # the text that opens every call
    head: str  # begin of a call, with {name} for the JSON-escaped tool name
    end: str
    separator: str  # between parallel calls

    def begin(self, tool_name: str) -> str:
        return self.head.replace("{name}", json.dumps(tool_name)[1:-1])


FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", "<tool_call>", '<tool_call>\n{"name": "{name}", "arguments": ',
                         "}\n</tool_call>", "\n"),
    "llama3": ToolFormat("llama3", '{"name": "', '{"name": "{name}", "parameters": ', "}", "\n"),
}


def detect_format(chat_template: str | None, configured: str = "auto") -> ToolFormat:
    """The format the model's template teaches (configured: the engine's tool_call_parser)."""
    if configured != "auto":
        return FORMATS[configured]
    template = chat_template or ""
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if '"parameters"' in template or "<|python_tag|>" in template:
        return FORMATS["llama3"]
    return FORMATS["hermes"]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class _Call:
    tool: Tool
    id: str
    args: list[str] = field(default_factory=list)
    depth: int = 0
    in_string: bool = False
    escape: bool = False
    started: bool = False
    done: bool = False  # the arguments object has closed
    closed: bool = False  # the end marker has been read too


class ToolCallParser:
    """Splits a stream of text into content and tool-call deltas (`feed`), and the whole
    into content and ToolCall objects (`result`). One parser per generated sample."""

    def __init__(self, fmt: ToolFormat, tools: Sequence[Tool]) -> None:
        self.fmt = fmt
        self._heads = {fmt.begin(t.name): t for t in tools}
        self._buf = ""
        self._state = "text"  # text | head | args | tail
        self._calls: list[_Call] = []
        self._content: list[str] = []
        self._tail_seen = 0

    # -- streaming ----------------------------------------------------------------------------

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """(content delta, tool-call deltas) for `text`, the next piece of the output."""
        self._buf += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        progress = True
        while progress and self._buf:
            progress = getattr(self, "_step_" + self._state)(content, deltas)
        out = "".join(content)
        self._content.append(out)
        return out, deltas

    def flush(self) -> str:
        """Text held back at the end (a partial trigger or an unfinished call head): content."""
        rest = self._buf if self._state in ("text", "head") else ""
        self._buf = ""
        self._content.append(rest)
        return rest

    def _step_text(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        trigger = self.fmt.trigger
        at = self._buf.find(trigger)
        if at >= 0:
            content.append(self._buf[:at])
            self._buf = self._buf[at:]
            self._state = "head"
            return True
        keep = _partial_suffix(self._buf, trigger)
        content.append(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _step_head(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        for head, tool in self._heads.items():
            if self._buf.startswith(head):
                call = _Call(tool, new_call_id())
                self._calls.append(call)
                deltas.append(ToolCallDelta(len(self._calls) - 1, call.id, tool.name, ""))
                self._buf = self._buf[len(head):]
                self._state = "args"
                return True
        if any(head.startswith(self._buf) for head in self._heads):
            return False  # wait for more text
        # Not a call after all (only possible without a grammar): the trigger is content.
        content.append(self._buf[0])
        self._buf = self._buf[1:]
        self._state = "text"
        return True

    def _step_args(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        call = self._calls[-1]
        used = _scan(call, self._buf)
        piece, self._buf = self._buf[:used], self._buf[used:]
        if piece:
            call.args.append(piece)
            deltas.append(ToolCallDelta(len(self._calls) - 1, arguments=piece))
        if call.done:
            self._state, self._tail_seen = "tail", 0
            return True
        return False

    def _step_tail(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        end = self.fmt.end
        while self._buf and self._tail_seen < len(end) and self._buf[0] == end[self._tail_seen]:
            self._buf = self._buf[1:]
            self._tail_seen += 1
        if self._tail_seen == len(end):
            self._calls[-1].closed = True
            self._state = "text"
            return True
        if self._buf:  # something else follows the arguments: treat it as content
            self._state = "text"
            return True
        return False

    # -- the whole output ---------------------------------------------------------------------

    def result(self) -> tuple[str, list[ToolCall]]:
        """(content, complete calls) after the last feed/flush. A call cut off before its
        arguments closed (max_new_tokens) is left out, and its text counted as content."""
        calls: list[ToolCall] = []
        extra: list[str] = []
        for call in self._calls:
            text = "".join(call.args)
            if not call.done:
                extra.append(self.fmt.begin(call.tool.name) + text)
                continue
            arguments = json.loads(text)
            value = _validated(call.tool, arguments)
            calls.append(ToolCall(call.id, call.tool.name, arguments, text, value, index=len(calls)))
        return "".join(self._content) + "".join(extra), calls


def _validated(tool: Tool, arguments: dict[str, Any]) -> Any:
    try:
        return tool.validate(arguments)
    except Exception:  # noqa: BLE001 - a keyword the grammar cannot enforce; arguments stay
        return None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _scan(call: _Call, text: str) -> int:
    """Advance the JSON scanner of `call` over `text`; how many characters belong to the
    arguments object (all of them until it closes)."""
    for i, ch in enumerate(text):
        if not call.started:
            if ch.isspace():
                continue
            call.started = True
        if call.in_string:
            if call.escape:
                call.escape = False
            elif ch == "\\":
                call.escape = True
            elif ch == '"':
                call.in_string = False
            continue
        if ch == '"':
            call.in_string = True
        elif ch in "{[":
            call.depth += 1
        elif ch in "}]":
            call.depth -= 1
            if call.depth == 0:
                call.done = True
                return i + 1
    return len(text)
