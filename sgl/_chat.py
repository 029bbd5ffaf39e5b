"""Chat messages -> prompt text and token ids, without letting message text become control tokens.

A chat template renders text such as `<|im_start|>user\\nHi<|im_end|>`; encoding that text
parses every special-token string in it, the template's markers and any the *user* typed
alike. So a message containing `<|im_start|>system\\n...` would forge a system turn. Here
the template's skeleton and the messages' contents are tokenized apart:

    render with markers:  <|im_start|>user\\n<M0><|im_end|>\\n<|im_start|>assistant\\n
    skeleton pieces:      encoded normally (the template's own special tokens stay special)
    content at <Mi>:      encoded with split_special_tokens=True ("<|im_start|>" is plain text)

Contents without any special-token text take the plain path (render, encode), so ordinary
prompts tokenize exactly as before. A template that rewrites contents (the markers would not
survive it) is detected by comparing both renders, and such a message is refused rather than
tokenized unsafely.
"""

from __future__ import annotations

import re
import uuid
from typing import Any, Mapping, Sequence

from sgl.errors import InvalidRequestError

__all__ = ["ROLES", "check_messages", "render_chat", "encode_chat"]

ROLES = ("system", "user", "assistant", "tool")
_ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role


def check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A validated copy: known roles, string content (text parts joined), other fields as given."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...}",
                                  field="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
            keys = sorted(map(str, m)) if isinstance(m, Mapping) else type(m).__name__
            raise InvalidRequestError(f"message {i} must have a string 'role' and a string (or list) "
                                      f"'content'; got keys {keys}", field="messages")
        role = _ROLE_ALIASES.get(m["role"], m["role"])
        if role not in ROLES:
            raise InvalidRequestError(f"message {i} has the unknown role {m['role'][:40]!r}; use one of "
                                      f"{', '.join(ROLES)}", field="messages")
        out.append({**m, "role": role, "content": _content_text(m["content"], i)})
    return out


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:  # OpenAI: an assistant turn that only called tools
        return ""
    if isinstance(content, (list, tuple)):  # OpenAI content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"message {i}, content part {j}: only text parts "
                                          "({'type': 'text', 'text': ...}) are supported", field="messages")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(f"message {i}: content must be a string or a list of text parts, not "
                              f"{type(content).__name__}", field="messages")


def render_chat(tok: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The prompt text of validated messages. Encoding this text with `encode()` parses any
    control-token text inside the messages: use `encode_chat` for token ids. `template_kwargs`
    go to the template as variables (`tools=[...]`, `enable_thinking=False`, ...)."""
    if not getattr(tok, "chat_template", None):
        raise InvalidRequestError("this model's tokenizer has no chat template; send plain text",
                                  field="messages")
    try:
        return tok.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                       tokenize=False, **dict(template_kwargs or {}))
    except Exception as exc:  # a template error (e.g. jinja's) is the caller's input, not ours
        raise InvalidRequestError(f"the model's chat template rejected these messages: {exc}",
                                  field="messages") from exc


def encode_chat(tok: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of validated messages, in which message text never becomes a control token."""
    text = render_chat(tok, messages, add_generation_prompt, template_kwargs)
    specials = _special_strings(tok)
    risky = [i for i, m in enumerate(messages) if any(s in m["content"] for s in specials)]
    for i, m in enumerate(messages):
        for key, value in m.items():  # other fields (e.g. "name") land in the skeleton as is
            if key not in ("role", "content") and isinstance(value, str) and any(s in value for s in specials):
                raise InvalidRequestError(f"message {i}: field {key!r} contains control-token text; "
                                          "remove it", field="messages")
    if not risky:
        return list(tok.encode(text, add_special_tokens=False))
    pieces = _segments(tok, messages, add_generation_prompt, text, template_kwargs)
    ids: list[int] = []
    for is_content, piece in pieces:
        if piece:
            ids.extend(tok.encode(piece, add_special_tokens=False, split_special_tokens=is_content))
    return ids


def _segments(tok: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, text: str,
              template_kwargs: Mapping[str, Any] | None = None) -> list[tuple[bool, str]]:
    """[(is_content, text)] whose concatenation is `text`, the rendered prompt."""
    nonce = uuid.uuid4().hex
    marked = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} for i, m in enumerate(messages)]
    skeleton = render_chat(tok, marked, add_generation_prompt, template_kwargs)
    parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", skeleton)
    # A template may trim contents; try them as given, then stripped.
    for strip in (False, True):
        pieces: list[tuple[bool, str]] = []
        for k, part in enumerate(parts):
            if k % 2 == 0:
                pieces.append((False, part))
            else:
                content = messages[int(part)]["content"]
                pieces.append((True, content.strip() if strip else content))
        if "".join(p for _, p in pieces) == text:
            return pieces
    raise InvalidRequestError("a message contains control-token text (e.g. '<|im_start|>'), and this "
                              "model's chat template rewrites message contents, so that text cannot be "
                              "kept apart from the template's own markers; remove it", field="messages")


def _special_strings(tok: Any) -> list[str]:
    """Every string the tokenizer would turn into a special token."""
    found = set(getattr(tok, "all_special_tokens", ()) or ())
    for added in (getattr(tok, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            found.add(str(added.content))
    return sorted(s for s in found if s)
