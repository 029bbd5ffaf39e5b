"""Chat templates as role prefix/suffix strings, derived from a model's own Jinja template.

A program writes `sgl.user("hi")`; the state appends the user prefix, the content and the user
suffix. The strings come from rendering the tokenizer's template around placeholder contents
and cutting the text at the placeholders::

    render([user A, assistant B, user C]) - render([user A, assistant B])
        = "<|im_start|>user\\n" + C + "<|im_end|>\\n"   ->  prefix, suffix of "user"

Later turns are used (not the first) so that what a template prints once per conversation
(a BOS text, a default system message) is not mistaken for part of a role. A default system
message (SmolLM2, Qwen2) becomes `default_system_prompt`, which the interpreter inserts like
SGLang does, so a program's text equals `apply_chat_template(messages)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["ChatTemplate", "get_chat_template", "chat_template_from_tokenizer"]

_PH = ("SGLPHXUSERONE", "SGLPHXASSTONE", "SGLPHXUSERTWO", "SGLPHXASSTTWO", "SGLPHXSYSTEM")


@dataclass(frozen=True)
class ChatTemplate:
    """Role strings of a chat format (SGLang's `ChatTemplate` fields and method)."""

    name: str
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    default_system_prompt: str | None = None
    stop_str: tuple[str, ...] = ()
    image_token: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def get_prefix_and_suffix(
        self, role: str, hist_messages: Sequence[dict[str, Any]] = ()
    ) -> tuple[str, str]:
        try:
            return self.role_prefix_and_suffix[role]
        except KeyError:
            raise ValueError(
                f"chat template {self.name!r} has no role {role!r}; roles: "
                f"{sorted(self.role_prefix_and_suffix)}"
            ) from None


_NAMED = {
    # SGLang's "default" template: plain-text roles for base models.
    "default": ChatTemplate(
        "default",
        {"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"), "assistant": ("ASSISTANT:", "\n")},
    ),
    "chatml": ChatTemplate(
        "chatml",
        {
            "system": ("<|im_start|>system\n", "<|im_end|>\n"),
            "user": ("<|im_start|>user\n", "<|im_end|>\n"),
            "assistant": ("<|im_start|>assistant\n", "<|im_end|>\n"),
        },
        stop_str=("<|im_end|>",),
    ),
    "llama-3-instruct": ChatTemplate(
        "llama-3-instruct",
        {
            role: (f"<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>")
            for role in ("system", "user", "assistant")
        },
        stop_str=("<|eot_id|>",),
    ),
}


def get_chat_template(name: str = "default") -> ChatTemplate:
    """A built-in template by name: "default", "chatml", "llama-3-instruct"."""
    try:
        return _NAMED[name]
    except KeyError:
        raise ValueError(f"unknown chat template {name!r}; known: {sorted(_NAMED)}") from None


def chat_template_from_tokenizer(tokenizer: Any, name: str = "hf") -> ChatTemplate:
    """Derive role strings from `tokenizer.apply_chat_template`; "default" when it has none."""
    if getattr(tokenizer, "chat_template", None) is None:
        return get_chat_template("default")

    def render(messages: list[dict[str, str]], gen: bool = False) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    u1, a1, u2, a2, sp = _PH
    turns = [{"role": "user", "content": u1}, {"role": "assistant", "content": a1},
             {"role": "user", "content": u2}, {"role": "assistant", "content": a2}]
    try:
        texts = [render(turns[:k]) for k in (2, 3, 4)]
        gen_prompt = render(turns[:3], gen=True)[len(texts[1]) :]
    except Exception as exc:  # a template that needs tools, images, strict alternation...
        raise ValueError(f"cannot derive role strings from the chat template: {exc}") from exc
    user = _split(texts[1], texts[0], u2)
    assistant = _split(texts[2], texts[1], a2)
    if gen_prompt and assistant[0] != gen_prompt:
        # Templates that decorate past assistant turns (reasoning tags): generate after the
        # generation prompt the model was trained with.
        assistant = (gen_prompt, assistant[1])

    bos = getattr(tokenizer, "bos_token", None) or ""
    preamble_of = (lambda text: bos if bos and text.startswith(bos) and not user[0].startswith(bos) else "")
    system, default_system = _system_roles(render, user, preamble_of, sp, u1)
    roles = {"user": user, "assistant": assistant}
    if system is not None:
        roles["system"] = system
    else:  # templates that refuse a system role: send it as a user turn
        roles["system"] = user
    stop = tuple(s for s in {assistant[1].strip()} if s)
    return ChatTemplate(name, roles, default_system_prompt=default_system, stop_str=stop)


def _split(longer: str, shorter: str, placeholder: str) -> tuple[str, str]:
    if not longer.startswith(shorter) or placeholder not in longer[len(shorter) :]:
        raise ValueError("chat template does not render turns incrementally")
    prefix, _, suffix = longer[len(shorter) :].partition(placeholder)
    return prefix, suffix


def _system_roles(render: Any, user: tuple[str, str], preamble_of: Any, sp: str, u1: str
                  ) -> tuple[tuple[str, str] | None, str | None]:
    user_turn = user[0] + u1 + user[1]
    try:
        with_system = render([{"role": "system", "content": sp}, {"role": "user", "content": u1}])
    except Exception:
        return None, None
    head, found, rest = with_system.partition(sp)
    if not found or user_turn not in rest:
        return None, None
    head = head[len(preamble_of(head)) :]
    system = (head, rest[: rest.index(user_turn)])
    user_only = render([{"role": "user", "content": u1}])
    head_u = user_only[: user_only.rindex(user_turn)]
    head_u = head_u[len(preamble_of(head_u)) :]
    default = None
    if head_u and head_u.startswith(system[0]) and head_u.endswith(system[1]):
        default = head_u[len(system[0]) : len(head_u) - len(system[1])] or None
    return system, default
