"""The sgl program language: SGLang's frontend (`function`, `gen`, `select`, roles, `fork`),
running in process and natively under asyncio. See docs/language.md.

Importing this package does not import torch: `sgl.Engine` is reached only when a program
runs on one (wrapped by `EngineBackend`).
"""

from __future__ import annotations

from sgl.lang.api import (assistant, assistant_begin, assistant_end, flush_cache, function, gen,
                          gen_int, gen_string, get_default_backend, get_server_info, image, select,
                          set_default_backend, system, system_begin, system_end, user, user_begin,
                          user_end, video)
from sgl.lang.backend import Backend, Completion, CompletionChunk, Prompt
from sgl.lang.chat import ChatTemplate, chat_template_from_tokenizer, get_chat_template
from sgl.lang.choices import (ChoicesDecision, ChoicesSamplingMethod, greedy_token_selection,
                              token_length_normalized, unconditional_likelihood_normalized)
from sgl.lang.engine_backend import EngineBackend
from sgl.lang.fake_backend import CharTokenizer, FakeBackend, FakeRequest
from sgl.lang.function import SglFunction
from sgl.lang.state import ProgramState, ProgramStateGroup
from sgl.lang.tools import tool_call, tools_prompt

__all__ = [
    # writing programs (SGLang names)
    "function", "gen", "gen_int", "gen_string", "select", "image", "video", "tool_call", "tools_prompt",
    "system", "user", "assistant",
    "system_begin", "system_end", "user_begin", "user_end", "assistant_begin", "assistant_end",
    "token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized",
    "ChoicesSamplingMethod", "ChoicesDecision",
    # running them
    "set_default_backend", "get_default_backend", "flush_cache", "get_server_info",
    "SglFunction", "ProgramState", "ProgramStateGroup",
    # backends
    "Backend", "Prompt", "Completion", "CompletionChunk", "EngineBackend", "FakeBackend",
    "FakeRequest", "CharTokenizer", "ChatTemplate", "get_chat_template",
    "chat_template_from_tokenizer",
]
