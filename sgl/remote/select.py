"""Text-mode `select` for remote backends: score choices from the server's own tokenization.

A remote backend without a local tokenizer cannot split prompt+choice into tokens itself, so it
asks the server for the prompt logprobs of the prompt and of each prompt+choice in one batch.
The choice's tokens are those after the common prefix with the prompt's tokens, as in the
in-process `Backend.select`: "Answer:" + " True" may tokenize differently at the boundary than
"Answer:" followed by " True", and the common prefix absorbs that.

The backends differ only in how they fetch logprobs and how they identify a token: the native
protocol returns token ids, the OpenAI completions API only token texts.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Literal, Sequence

from sgl._seq import common_prefix_len
from sgl.lang.backend import TokenLogprobTuple
from sgl.lang.choices import ChoicesDecision, ChoicesSamplingMethod, normalized_logprob

__all__ = ["select_by_text"]

Rows = list[list[TokenLogprobTuple]]


async def select_by_text(
    prompt_text: str,
    choices: Sequence[str],
    method: ChoicesSamplingMethod,
    prompt_logprobs: Callable[[list[str]], Awaitable[Rows]],
    unconditional_logprobs: Callable[[Rows], Awaitable[Rows]],
    token_key: Literal[1, 2],
) -> ChoicesDecision:
    """Let `method` pick one of `choices` as a continuation of `prompt_text`.

    `prompt_logprobs(texts)` returns the prompt token logprobs of each text, in order;
    `unconditional_logprobs(rows)` scores each choice's own tokens without the prompt (only
    called when `method` needs it); `token_key` is the index in a (logprob, id, text) tuple
    that identifies a token: 1 for ids, 2 for token texts.
    """
    # An empty prompt has no tokens to share: skip scoring it.
    texts = ([prompt_text] if prompt_text else []) + [prompt_text + c for c in choices]
    rows = await prompt_logprobs(texts)
    base = [t[token_key] for t in rows[0]] if prompt_text else []
    full = rows[1:] if prompt_text else rows
    starts = [common_prefix_len(base, [t[token_key] for t in row]) for row in full]
    inputs = [row[s:] for row, s in zip(full, starts)]
    uncond = await unconditional_logprobs(inputs) if method.requires_unconditional_logprobs else None
    return method(choices=list(choices), normalized_prompt_logprobs=[normalized_logprob(r) for r in inputs],
                  input_token_logprobs=inputs, output_token_logprobs=[[] for _ in choices],
                  unconditional_token_logprobs=uncond)
