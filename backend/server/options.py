"""The server's own options: request bounds, HTTP limits and local-server safety.

One frozen dataclass, validated at construction. Each field carries its help text in its
metadata, so `sgl serve --help` and docs/operations.md describe the same thing; the CLI turns
every field into a flag (`max_n` -> `--max-n`), so a field added here is a flag at once.

Why bounds at the HTTP edge when the engine validates too: one JSON number (`n`, a
top-logprobs count, a stop list) multiplies the work or the response size of a request, and a
server shared by several users must refuse that before any of it happens, with a 4xx that names
the limit and the flag that raises it.

One limit, one option: a bound the engine enforces as well has the same name here as in
`EngineConfig` (`max_n`, `max_grammar_bytes`, ...). When the hosted engine's config has that
field, its value is the one the edge applies (`for_engine`) and `sgl serve` has a single flag
for it, the engine's; the field here is the value for an engine without that option.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ServerOptions"]


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ServerOptions:
    # -- request bounds (400 naming the limit) --------------------------------------------------
    max_n: int = _opt(64, "most samples per prompt (`n`)")
    max_batch: int = _opt(256, "most outputs one request may ask for: prompts x n")
    max_top_logprobs_num: int = _opt(20, "most alternatives per token: native `top_logprobs_num`, "
                                         "OpenAI `top_logprobs` / completions `logprobs` (OpenAI's own cap)")
    max_stop_strings: int = _opt(32, "most stop strings per request (`stop`)")
    max_stop_string_len: int = _opt(256, "longest stop string, in characters")
    max_stop_token_ids: int = _opt(256, "most entries in `stop_token_ids`")
    max_stop_regexes: int = _opt(32, "most stop regexes per request (`stop_regex`)")
    max_stop_regex_len: int = _opt(256, "longest stop regex, in characters")
    max_grammar_bytes: int = _opt(64 * 1024, "largest regex, EBNF grammar or JSON schema, in UTF-8 bytes "
                                             "(`regex`, `ebnf`, `json_schema`, `response_format`)")
    max_body_bytes: int = _opt(4 * 1024 * 1024, "largest request body, in bytes (413 beyond)")
    max_json_depth: int = _opt(64, "deepest nesting of arrays and objects in a request body")
    # -- HTTP server ------------------------------------------------------------------------------
    header_timeout: float = _opt(10.0, "seconds a client has to send a request's headers, and "
                                       "again its body; a stalled connection is closed")
    timeout_keep_alive: int = _opt(5, "seconds an idle keep-alive connection stays open")
    max_connections: int = _opt(1000, "open connections at most; beyond it the longest-idle "
                                      "connection that has no request running is closed (lowered "
                                      "to fit the process's open-file limit)")
    # -- local-server safety (applies when no API key is set) ----------------------------------
    allowed_origins: tuple[str, ...] = _opt((), "browser origins allowed besides the server's own "
                                                "(comma list, `*` for any); they also get CORS headers")
    allowed_hosts: tuple[str, ...] = _opt((), "Host header names allowed besides localhost, IP "
                                              "addresses and the bound host (comma list, `*` for any)")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", "float"):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                    raise ValueError(f"server option {f.name}={value!r}: must be a positive number")
                if f.type == "int" and not isinstance(value, int):
                    raise ValueError(f"server option {f.name}={value!r}: must be an integer")
            elif isinstance(value, str):  # a comma list given as one string
                object.__setattr__(self, f.name, split_list(value))
            elif not all(isinstance(v, str) for v in value):
                raise ValueError(f"server option {f.name}: must be a list of strings")

    def for_engine(self, engine_config: Any) -> ServerOptions:
        """These options with every bound the engine's config also has taken from the engine."""
        if not dataclasses.is_dataclass(engine_config):
            return self
        names = {f.name for f in dataclasses.fields(self)}
        shared = {f.name: getattr(engine_config, f.name) for f in dataclasses.fields(engine_config)
                  if f.name in names}
        return dataclasses.replace(self, **shared) if shared else self

    @staticmethod
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    @classmethod
    def field_help(cls) -> dict[str, tuple[Any, str]]:
        """name -> (default, help) for every option, in declaration order."""
        return {f.name: (f.default, f.metadata["help"]) for f in dataclasses.fields(cls)}


def split_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())
