"""Reasoning models: telling the `<think>...</think>` part of an output from its answer.

Qwen3 writes `<think>\\n...\\n</think>\\n\\n` then the answer; DeepSeek-R1's template (and newer
Qwen3 templates) already open `<think>` in the prompt, so the output starts inside the
reasoning. The parser (engine option `reasoning_parser`, SGLang's `--reasoning-parser`):

- "auto" (default): on when the chat template mentions `<think>`; whether the output starts
  inside the reasoning is read from the prompt itself (it ends with an open `<think>`), and a
  prompt that ends with `</think>` (an empty reasoning closed by the template, as Qwen3's does
  for enable_thinking=False) turns it off for that request.
- "qwen3": on; the output starts inside only when the prompt opened `<think>`.
- "deepseek-r1": on; the output always starts inside the reasoning (R1 may or may not repeat
  the opening tag; a leading `<think>` is dropped either way).
- "none": never split.

`ReasoningSplitter` splits text incrementally (streaming) and holds back only what could be the
start of a marker, so streamed reasoning never shows half a `</think>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ReasoningParserName", "ReasoningMode", "THINK_START", "THINK_END", "reasoning_mode",
           "ReasoningSplitter"]

ReasoningParserName = Literal["auto", "none", "qwen3", "deepseek-r1"]
THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningMode:
    """How one request's output is read: `inside` when it starts within the reasoning."""

    inside: bool


def reasoning_mode(parser: str, chat_template: str | None, prompt_tail: str) -> ReasoningMode | None:
    """The request's mode, or None when its output is not split. `prompt_tail` is the end of
    the rendered prompt (a few dozen characters are enough)."""
    if parser == "none":
        return None
    if parser == "auto" and THINK_START not in (chat_template or ""):
        return None
    if prompt_tail.rstrip().endswith(THINK_END):
        return None  # the prompt closed an empty reasoning (Qwen3 with enable_thinking=False)
    opened = prompt_tail.rfind(THINK_START) > prompt_tail.rfind(THINK_END)
    return ReasoningMode(inside=opened or parser == "deepseek-r1")


class ReasoningSplitter:
    """feed(text) -> (reasoning delta, content delta); see the module docstring."""

    def __init__(self, mode: ReasoningMode) -> None:
        # "start": may still see an opening tag; "inside": in the reasoning; "after": answer.
        self._state = "start"
        self._inside_at_start = mode.inside
        self._buf = ""
        self._content_started = False
        self.reasoning: list[str] = []
        self.content: list[str] = []

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = "", ""
        if self._state == "start":
            stripped = self._buf.lstrip()
            if THINK_START.startswith(stripped) and len(stripped) < len(THINK_START):
                return "", ""  # could still be the opening tag
            if stripped.startswith(THINK_START):
                self._buf = stripped[len(THINK_START):]
                self._state = "inside"
            else:
                self._state = "inside" if self._inside_at_start else "after"
        if self._state == "inside":
            at = self._buf.find(THINK_END)
            if at < 0:
                keep = _partial_suffix(self._buf, THINK_END)
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                self.reasoning.append(reasoning)
                return reasoning, ""
            reasoning, self._buf = self._buf[:at], self._buf[at + len(THINK_END):]
            self.reasoning.append(reasoning)
            self._state = "after"
        content, self._buf = self._answer(self._buf), ""
        return reasoning, content

    def _answer(self, text: str) -> str:
        if not self._content_started:  # the blank lines after </think> are not the answer
            text = text.lstrip()
            self._content_started = bool(text)
        self.content.append(text)
        return text

    def flush(self) -> tuple[str, str]:
        """Whatever was held back, at the end of the output."""
        rest, self._buf = self._buf, ""
        if self._state == "inside" or (self._state == "start" and self._inside_at_start):
            self.reasoning.append(rest)
            return rest, ""
        return "", self._answer(rest)

    @property
    def ended(self) -> bool:
        """Whether the reasoning has ended (the answer began)."""
        return self._state == "after"


def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
