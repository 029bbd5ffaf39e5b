"""Quickstart: generate with the embedded default model (SmolLM2-135M-Instruct) on the CPU.

    python examples/quickstart.py
"""

from __future__ import annotations

import asyncio

import sgl


async def main() -> None:
    async with sgl.Engine() as engine:  # no model given: the embedded default
        # One prompt, greedy.
        out = await engine.generate(
            [{"role": "user", "content": "What is the capital of France?"}],
            max_new_tokens=32,
            temperature=0,
        )
        print("chat:", out.text, f"({out.finish_reason}, {out.usage})")

        # Several prompts at once are batched continuously by the engine.
        outs = await engine.generate(
            ["The three primary colors are", "A haiku about the sea:"],
            max_new_tokens=24,
            temperature=0,
        )
        for o in outs:
            print("batch:", repr(o.text))

        # Streaming: chunks concatenate to the final text.
        print("stream: ", end="", flush=True)
        async for chunk in engine.stream("Once upon a time", max_new_tokens=32, temperature=0.7, seed=1):
            print(chunk.text, end="", flush=True)
        print()
        print(engine.stats())


if __name__ == "__main__":
    asyncio.run(main())
