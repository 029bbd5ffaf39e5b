"""Streaming a program's output: sync `text_iter` and async `text_async_iter`.

    python examples/streaming.py

`f.run(..., stream=True)` returns the state at once and the gens stream from the engine;
`state.text_iter("story")` yields the variable's text as it grows and ends when it is final.
`await f.arun(..., stream=True)` with `async for ... in state.text_async_iter(...)` is the same
on the caller's event loop. The chunks always concatenate to the final value.
"""

from __future__ import annotations

import asyncio

import sgl


@sgl.function
def story(s, subject):
    s += sgl.user(f"Write two sentences about {subject}.")
    # min_tokens keeps even a terse model talking long enough to show several chunks.
    s += sgl.assistant(sgl.gen("story", max_tokens=32, min_tokens=8))


def stream_sync(subject: str) -> tuple[list[str], str]:
    state = story.run(subject=subject, stream=True, temperature=0)
    chunks = []
    for chunk in state.text_iter("story"):
        print(chunk, end="", flush=True)
        chunks.append(chunk)
    print()
    return chunks, state["story"]


async def stream_async(subject: str) -> tuple[list[str], str]:
    state = await story.arun(subject=subject, stream=True, temperature=0)
    chunks = []
    async for chunk in state.text_async_iter("story"):
        print(chunk, end="", flush=True)
        chunks.append(chunk)
    print()
    # Read the final value here: the state lives on this event loop, which asyncio.run closes.
    return chunks, await state.aget("story")


def main(engine: sgl.Engine | None = None) -> dict[str, tuple[list[str], str]]:
    """Stream one story each way; returns {"sync"|"async": (chunks, final text)}."""
    own = engine is None
    engine = engine or sgl.Engine()
    sgl.set_default_backend(engine)
    try:
        print("sync text_iter:")
        results = {"sync": stream_sync("a lighthouse")}
        print("async text_async_iter:")
        results["async"] = asyncio.run(stream_async("a mountain"))
        for mode, (chunks, final) in results.items():
            print(f"{mode}: {len(chunks)} chunks, joined == final value: {''.join(chunks) == final}")
        return results
    finally:
        if own:
            engine.close()


if __name__ == "__main__":
    main()
