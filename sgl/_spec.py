"""RequestSpec: what `sgl.Engine` hands the backend for one prompt (the runtime seam's input).

A plain dataclass on the product side: the backend builds its own request objects from it
(one per sample) and applies every policy default there (jump-forward, per-sample seeds,
the deadline from `request_timeout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from sgl.sampling import LogprobOptions, SamplingParams

Sink = Callable[[str, Any], None]  # (kind, payload) on the engine thread; see sgl/_requests.py


@dataclass(frozen=True)
class RequestSpec:
    prompt_ids: Sequence[int]
    params: SamplingParams
    logprob: LogprobOptions
    sinks: Sequence[Sink]  # one per sample (params.n)
    stream: bool = False
    timeout: float | None = None  # seconds; None: the engine's request_timeout
    constraint: Any = None  # a compiled constraint from Runtime.compile_constraint, or None
