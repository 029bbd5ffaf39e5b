"""Multi-token decode on a CUDA device: speculative verification and jumped tokens replayed
by the decode graphs, one graph row per token, give the outputs of one-token decoding.

Marked `gpu` (skipped without CUDA). Tiny random-weight Llama in float32 (as
tests/test_gpu_engine.py), and the real default model for jump-forward (it needs a tokenizer).
Random weights rarely repeat their prompt, so the speculative engine's drafter is replaced by
one that always proposes the last known tokens: every step then verifies a full draft, some
accepted, most rejected, and the outputs must still equal plain decoding.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from pydantic import BaseModel
from test_gpu_engine import GREEDY, copy_weights, engine, prompts

import sgl

pytestmark = pytest.mark.gpu


def _always_draft(e: sgl.Engine) -> None:
    drafter = e._rt.scheduler.drafter
    drafter.propose = lambda r, limit: (r.prompt_ids + r.output_ids)[-limit:] if limit >= 1 else []


def _count_replays(e: sgl.Engine) -> list[int]:
    """Counts steps where some request computes several tokens and a graph replays them."""
    runner = e._rt.runner
    assert runner.graphs is not None, "decode graphs were not captured"
    calls = [0]
    forward = runner._forward  # (every step's forward: whole, or the first half of a deferred one)

    def counted(step: Any) -> Any:
        if step.mode.name == "EXTEND" and step.graph_bs is not None:
            calls[0] += 1
        return forward(step)

    runner._forward = counted
    return calls


async def _gen(e: sgl.Engine, ps: list[list[int]], **kw: Any) -> list[list[int]]:
    outs = await asyncio.gather(*(e.generate(input_ids=p, max_new_tokens=6 + 5 * i, **kw)
                                  for i, p in enumerate(ps)))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_verification_in_graphs_equals_plain_decoding(sampling: str) -> None:
    kw = dict(GREEDY) if sampling == "greedy" else dict(temperature=0.9, seed=5, ignore_eos=True)
    ps = prompts(9, seed=3)
    plain = engine("cuda")
    spec = engine("cuda", speculative_algorithm="ngram", speculative_num_draft_tokens=3)
    try:
        copy_weights(plain, spec)
        _always_draft(spec)
        replays = _count_replays(spec)
        want = asyncio.run(_gen(plain, ps, **kw))
        got = asyncio.run(_gen(spec, ps, **kw))
        assert got == want
        assert replays[0] > 0, "no verify step used the multi-token graphs"
        stats = spec.stats()
        assert stats.spec_draft_tokens > 0 and stats.spec_verify_steps > 0
    finally:
        plain.close()
        spec.close()


class Item(BaseModel):
    name: str
    quantity: int
    tags: list[str]


def test_jump_forward_in_graphs_changes_only_speed() -> None:
    """Real model, float32: jumped tokens computed by multi-token graph steps give the same
    token ids as jump-forward off (one forced token per decode step)."""
    e = sgl.Engine(os.environ.get("SGL_TEST_MODEL") or None, device="cuda", dtype="float32",
                   max_total_tokens=16384)
    try:
        replays = _count_replays(e)

        async def go(jump: bool) -> list[sgl.GenerateOutput]:
            qs = [f"Describe item {i} (a {w}) as JSON." for i, w in enumerate(["lamp", "kettle", "map"])]
            return list(await asyncio.gather(*(e.generate(q, schema=Item, max_new_tokens=80, temperature=0,
                                                          jump_forward=jump) for q in qs)))

        on, off = asyncio.run(go(True)), asyncio.run(go(False))
        assert [o.token_ids for o in on] == [o.token_ids for o in off]
        assert replays[0] > 0, "no jumped tokens went through the multi-token graphs"
    finally:
        e.close()
