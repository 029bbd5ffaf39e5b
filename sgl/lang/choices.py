"""How `select` turns per-choice token logprobs into a decision.

The three methods of SGLang, with its names and meta-info keys. Each token logprob is a tuple
`(logprob, token_id, text)` as in SGLang's `input_token_logprobs`, so a custom
`ChoicesSamplingMethod` written for SGLang works unchanged.

- `token_length_normalized` (default): highest mean logprob over the choice's tokens.
- `greedy_token_selection`: compare token by token, keeping the choices tied for the best
  logprob at each position; a shorter choice is padded with its own mean logprob.
- `unconditional_likelihood_normalized`: highest mean of (conditional - unconditional)
  logprob, i.e. how much the prompt raises the choice above its prior likelihood.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = [
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "TokenLengthNormalized",
    "GreedyTokenSelection",
    "UnconditionalLikelihoodNormalized",
    "token_length_normalized",
    "greedy_token_selection",
    "unconditional_likelihood_normalized",
    "resolve_choices_method",
]

TokenLogprobTuple = tuple  # (logprob, token_id, text)


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] | None = None


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


def _values(tokens: Sequence[TokenLogprobTuple]) -> list[float]:
    # A logprob of None / nan marks "no logprob" (the first token of a sequence).
    return [t[0] for t in tokens if t[0] is not None and not math.isnan(t[0])]


def _first_best(scores: Sequence[float]) -> int:
    best = 0
    for i, v in enumerate(scores):
        if v > scores[best]:
            best = i
    return best


class ChoicesSamplingMethod(ABC):
    """Picks one choice from its token logprobs. Subclass to write your own."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return False

    @abstractmethod
    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[TokenLogprobTuple]],
        output_token_logprobs: list[list[TokenLogprobTuple]],
        unconditional_token_logprobs: list[list[TokenLogprobTuple]] | None = None,
    ) -> ChoicesDecision: ...


def _base_meta(
    normalized: list[float], inputs: list[list[Any]], outputs: list[list[Any]]
) -> dict[str, Any]:
    return {
        "normalized_prompt_logprobs": normalized,
        "input_token_logprobs": inputs,
        "output_token_logprobs": outputs,
    }


class TokenLengthNormalized(ChoicesSamplingMethod):
    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        best = _first_best(normalized_prompt_logprobs)
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        return ChoicesDecision(choices[best], meta)


class GreedyTokenSelection(ChoicesSamplingMethod):
    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        rows = [_values(tokens) for tokens in input_token_logprobs]
        width = max((len(r) for r in rows), default=0)
        # Pad short choices with their mean so a prefix choice ("Yes" vs "Yes sir") competes
        # on its average quality instead of dropping out when it runs out of tokens.
        matrix = [r + [_mean(r) if r else float("-inf")] * (width - len(r)) for r in rows]
        alive = list(range(len(choices)))
        for col in range(width):
            top = max(matrix[i][col] for i in alive)
            alive = [i for i in alive if matrix[i][col] == top]
            if len(alive) == 1:
                break
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["greedy_logprob_matrix"] = matrix
        return ChoicesDecision(choices[alive[0]], meta)


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional logprobs")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            if len(cond) != len(uncond):
                raise ValueError("conditional and unconditional logprobs differ in length")
            # The unconditional first token has no context, hence no logprob: count it as 0.
            diffs = [
                (c[0] if c[0] is not None and not math.isnan(c[0]) else 0.0)
                - (u[0] if u[0] is not None and not math.isnan(u[0]) else 0.0)
                for c, u in zip(cond, uncond)
            ]
            scores.append(_mean(diffs))
        best = _first_best(scores)
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["unconditional_token_logprobs"] = unconditional_token_logprobs
        meta["normalized_unconditional_prompt_logprobs"] = scores
        return ChoicesDecision(choices[best], meta)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()

_BY_NAME = {
    "token_length_normalized": token_length_normalized,
    "greedy_token_selection": greedy_token_selection,
    "unconditional_likelihood_normalized": unconditional_likelihood_normalized,
}


def resolve_choices_method(method: ChoicesSamplingMethod | str | None) -> ChoicesSamplingMethod:
    """Accept the method objects (SGLang) or their names (sgl convenience)."""
    if method is None:
        return token_length_normalized
    if isinstance(method, str):
        try:
            return _BY_NAME[method]
        except KeyError:
            raise ValueError(f"unknown choices_method {method!r}; known: {sorted(_BY_NAME)}") from None
    if not callable(method):
        raise TypeError(f"choices_method must be a ChoicesSamplingMethod, got {method!r}")
    return method


def normalized_logprob(tokens: Sequence[TokenLogprobTuple]) -> float:
    """Mean logprob over tokens that have one (SGLang's normalized_prompt_logprobs)."""
    return _mean(_values(tokens))
