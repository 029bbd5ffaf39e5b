"""Prints, as JSON, which CPU library build served (`portable`) and the default model's greedy
tokens and their logprobs (as float reprs: compared bit for bit) for a few prompts, one at a
time on the default engine, then eight at once on a deterministic one. Run by
tests/test_cpu_portable.py in a process per build."""

from __future__ import annotations

import asyncio
import json

import sgl
from sgl.backend.quant import cpu_kernel


def tokens(out: sgl.GenerateOutput) -> list[list[object]]:
    return [[t.token_id, repr(t.logprob)] for t in out.logprobs.output]


async def main() -> None:
    outputs = []
    async with sgl.Engine(device="cpu", max_total_tokens=4096) as engine:  # the CPU default
        for prompt in ("The capital of France is", "def fib(n):", "Tell me about cats. " * 30):
            outputs.append(tokens(await engine.generate(prompt, max_new_tokens=24, temperature=0,
                                                        return_logprob=True)))
        lib = cpu_kernel._library()
        portable = lib.sgl_portable() if lib is not None else None
    # Eight at once: batched steps, whose composition depends on timing; row-invariant kernels
    # make each request's bits independent of it.
    async with sgl.Engine(device="cpu", max_total_tokens=4096,
                          enable_deterministic_inference=True) as engine:
        batch = await asyncio.gather(*(
            engine.generate("Tell me about cats. " * k, max_new_tokens=12, temperature=0,
                            return_logprob=True) for k in range(1, 9)))
        outputs += [tokens(o) for o in batch]
    print(json.dumps({"portable": portable, "outputs": outputs}))


if __name__ == "__main__":
    asyncio.run(main())
