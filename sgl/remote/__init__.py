"""Remote backends: run sgl programs against a server instead of an in-process engine.

- `RuntimeEndpoint(base_url)`: SGLang's native /generate protocol (an `sgl serve` server or an
  SGLang cluster); select with logprob scoring, constraints, streaming.
- `OpenAI(model, base_url=None)`: any OpenAI-compatible server (OpenAI, vLLM, SGLang, sgl),
  chat and completion models.

Only httpx (and, for `OpenAI`, the `openai` client) is imported: never torch.
"""

from __future__ import annotations

from sgl.remote.openai_backend import OpenAI
from sgl.remote.runtime_endpoint import RuntimeEndpoint

__all__ = ["RuntimeEndpoint", "OpenAI"]
