"""Small engines and probes shared by test modules (no weights to download, no GPU)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import sgl

# A tiny random-weight Llama with the default model's vocabulary, served with its tokenizer.
TOKENIZED_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=49152, max_position_embeddings=1024, eos_token_id=0)


def tokenized_tiny_engine(**options: Any) -> sgl.Engine:
    from sgl.backend.model_loader import resolve_model_path

    return sgl.Engine(model_config=TOKENIZED_TINY, load_format="dummy", device="cpu", max_total_tokens=4096,
                      tokenizer=str(resolve_model_path(None)), **options)


def start_ticker(gaps: list[float]) -> asyncio.Task:
    """Tick every 10 ms on the running loop, recording each gap: a blocked loop shows as one
    gap as long as the blocking call."""

    async def tick() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    return asyncio.create_task(tick())
