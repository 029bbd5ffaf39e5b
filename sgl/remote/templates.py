"""Role strings for a remote model, so that `sgl.user(...)` renders as the model expects.

An `sgl serve` server reports the model's Jinja chat template in /get_model_info; we render it
here (with jinja2, configured as transformers configures it) and derive role prefixes and
suffixes exactly as the in-process backend does, so a program's text, and hence its greedy
output, is the same locally and remotely. Servers that do not report a template (SGLang) get a
guess from the model path, which `chat_template=` overrides.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Sequence

from sgl.lang.chat import ChatTemplate, chat_template_from_tokenizer, get_chat_template

__all__ = ["template_from_model_info", "guess_template"]


class _JinjaTemplate:
    """The slice of a Hugging Face tokenizer that `chat_template_from_tokenizer` uses."""

    def __init__(self, source: str, bos_token: str | None, eos_token: str | None) -> None:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.chat_template = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self._template = env.from_string(source)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str:
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def guess_template(model_path: str) -> ChatTemplate:
    """A built-in template by model family (SGLang's habit); "default" when unknown."""
    name = model_path.lower()
    if "llama-3" in name or "llama3" in name:
        return get_chat_template("llama-3-instruct")
    if any(family in name for family in ("qwen", "smollm", "chatml", "yi-")):
        return get_chat_template("chatml")
    return get_chat_template("default")


def template_from_model_info(info: dict[str, Any]) -> ChatTemplate:
    source = info.get("chat_template")
    if isinstance(source, str) and source:
        try:
            shim = _JinjaTemplate(source, info.get("bos_token"), info.get("eos_token"))
            return chat_template_from_tokenizer(shim, name="remote")
        except Exception:  # noqa: BLE001 - a template we cannot render: fall back to a guess
            pass
    return guess_template(str(info.get("model_path") or ""))
