"""The decode stage (attention/decode_stage.py): attention with it equals attention without it.

Two TorchAttentionBackends share one FakePool: one keeps decode keys in a DecodeStage across
steps, the other gathers them anew each step (the reference). Every layer of every step must
give the same output, through requests joining and leaving, decode rows riding along with
prefill chunks, the stage growing, table slots rewritten behind its back, a step interrupted
part-way, and a budget too small for the batch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_attention_torch import FakePool, Step, make_forward_batch

from sgl.backend.attention.torch_backend import TorchAttentionBackend
from sgl.backend.forward_batch import ForwardMode

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 6, 2, 16, 2


class Pair:
    """A staged and a plain backend stepping over the same pool and requests."""

    def __init__(self, stage_positions: int = 4096, num_slots: int = 4096,
                 dtype: torch.dtype = torch.float32) -> None:
        self.pool = FakePool(LAYERS, num_slots, KV_HEADS, HEAD_DIM, dtype=dtype, max_context=1024)
        self.dtype = dtype
        self.staged = TorchAttentionBackend(stage_positions=stage_positions)
        self.plain = TorchAttentionBackend()
        self.lens: dict[int, int] = {}  # pool row -> tokens cached
        self.gen = torch.Generator().manual_seed(0)

    def step(self, new_tokens: dict[int, int], layers: int = LAYERS) -> None:
        """One step: request (pool row) -> number of new tokens; compares every layer."""
        steps = [Step(row, self.lens.get(row, 0), [0] * n) for row, n in new_tokens.items()]
        single = all(n == 1 for n in new_tokens.values())
        mode = ForwardMode.DECODE if single and self.lens.keys() >= new_tokens.keys() else ForwardMode.EXTEND
        fb = make_forward_batch(self.pool, self.staged, steps, mode)
        ref = dataclasses.replace(fb, attn_backend=self.plain)
        self.plain.prepare(ref)
        for layer in range(layers):
            q, k, v = (torch.randn(fb.num_tokens, h, HEAD_DIM, generator=self.gen).to(self.dtype)
                       for h in (HEADS, KV_HEADS, KV_HEADS))
            got = self.staged.forward(q, k, v, layer, 0.25, fb)
            want = self.plain.forward(q, k, v, layer, 0.25, ref)
            assert got.dtype == self.dtype
            tol = 1e-5 if self.dtype == torch.float32 else 1e-2
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        for row, n in new_tokens.items():
            self.lens[row] = self.lens.get(row, 0) + n

    def decode(self, rows: list[int], times: int = 1) -> None:
        for _ in range(times):
            self.step({row: 1 for row in rows})

    def leave(self, row: int) -> None:
        del self.lens[row]


def test_batch_life_joins_leaves_mixed_steps_and_growth() -> None:
    pair = Pair()
    pair.step({1: 7, 2: 30, 3: 1, 4: 12, 5: 50})  # prefill (row 3: a one-token prompt)
    pair.decode([1, 2, 3, 4, 5], times=3)
    stage = pair.staged.stage
    assert stage is not None and len(stage.row_of) == 5
    pair.leave(2)
    pair.decode([1, 3, 4, 5], times=2)  # row 5's stage row moves into the hole
    assert sorted(stage.row_of.values()) == [0, 1, 2, 3]
    # A prefill chunk with the decode rows riding along, and a one-token extend over a
    # cached prefix (row 6's earlier chunk) that joins the stage from a mixed step.
    pair.step({6: 20})
    pair.step({6: 1, 7: 9, 1: 1, 3: 1, 4: 1, 5: 1})
    pair.decode([5, 1, 6, 3, 4], times=2)  # new order: rows permuted against batch order
    pair.step({8: 300})  # a long prompt: the next decode outgrows the stage's capacity
    pair.decode([6, 8], times=2)  # (with the short rows too, the padded block would pass
    assert stage.capacity > 300  # the stage's bound of 2x the tokens held: gathered instead)
    # Padding keys are masked, yet a NaN there still turns SDPA's output into NaN: the stage's
    # never-written positions must hold finite values (it once allocated with torch.empty).
    assert all(bool(t.isfinite().all()) for t in stage.k + stage.v)


def test_bfloat16_pool() -> None:
    pair = Pair(dtype=torch.bfloat16)
    pair.step({1: 9, 2: 20, 3: 1})
    pair.decode([1, 2, 3], times=3)
    pair.leave(1)
    pair.decode([3, 2], times=2)
    assert pair.staged.stage is not None and pair.staged.stage.k[0].dtype == torch.bfloat16


def test_rewritten_table_slot_is_copied_again() -> None:
    # The radix cache may point a running request's position at another slot holding the
    # same token's KV; here the new slot holds different values, so a stale stage would show.
    pair = Pair()
    pair.step({1: 10, 2: 15})
    pair.decode([1, 2], times=2)
    fresh = pair.pool.alloc(1)
    for layer in range(LAYERS):
        pair.pool.k_buffer[layer][fresh] = torch.randn(1, KV_HEADS, HEAD_DIM)
        pair.pool.v_buffer[layer][fresh] = torch.randn(1, KV_HEADS, HEAD_DIM)
    pair.pool.req_to_token[2, 4] = fresh.int()
    pair.decode([1, 2], times=2)


def test_step_stopped_part_way_restarts_the_stage() -> None:
    pair = Pair()
    pair.step({1: 10, 2: 15})
    pair.decode([1, 2])
    pair.step({1: 1, 2: 1}, layers=1)  # layer 1 never copied its new keys in
    pair.decode([1, 2], times=2)


def test_request_replaced_in_its_pool_row_between_steps() -> None:
    pair = Pair()
    pair.step({1: 10, 2: 12})
    pair.decode([1, 2], times=2)
    # Row 2's request ends; a new request takes pool row 2 with a cached prefix that shares
    # the old request's first 8 slots, and joins with a one-token extend.
    pair.leave(2)
    pair.lens[2] = 8
    pair.step({1: 1, 2: 1})
    pair.decode([1, 2], times=2)


def test_batch_over_budget_falls_back_to_gathering() -> None:
    pair = Pair(stage_positions=64)
    pair.step({1: 40, 2: 30})
    pair.decode([1, 2], times=2)  # 2 rows x (41 + 1) positions > 64: no stage
    stage = pair.staged.stage
    assert stage is not None and not stage.row_of
    pair.decode([1], times=1)  # a lone request: read as a view or staged, either is right
    pair.step({3: 5})
    pair.decode([3, 1])


@pytest.mark.parametrize("seed", range(4))
def test_random_schedules(seed: int) -> None:
    rng = torch.Generator().manual_seed(seed)
    pair = Pair()
    next_row = 1
    for _ in range(25):
        running = list(pair.lens)
        new: dict[int, int] = {}
        if running and torch.rand(1, generator=rng) < 0.25:
            pair.leave(running[int(torch.randint(len(running), (1,), generator=rng))])
        for row in pair.lens:
            new[row] = 1
        if next_row < 15 and torch.rand(1, generator=rng) < 0.4:
            new[next_row] = int(torch.randint(1, 40, (1,), generator=rng))
            next_row += 1
        if new:
            order = torch.randperm(len(new), generator=rng).tolist()
            items = list(new.items())
            pair.step(dict(items[i] for i in order))


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_engine_frees_the_stage_when_idle_and_rebuilds_it(overlap: bool) -> None:
    import time

    from test_engine_core import assert_clean, make_engine, prompts

    # The stage serves where the fused C decode attention does not ("reference" kernels, or
    # no C library); "auto" reads the pool in place and never builds it (test_quant_memory).
    engine = make_engine(disable_overlap_schedule=not overlap, kernels="reference")
    try:
        core, stage = engine._rt.core, engine._rt.runner.attn_backend.stage
        core.idle_release_s = 0.3
        sizes: list[int] = []
        engine._rt.runner.step_hook = lambda step: sizes.append(len(stage.k))
        first = [o.token_ids for o in engine.generate_sync(
            input_ids=prompts(6), max_new_tokens=12, temperature=0)]
        assert max(sizes) == engine._rt.model_config.num_layers  # the batch ran staged
        deadline = time.monotonic() + 10
        # (both: the engine thread empties k, then slots; seen between them, the check failed)
        while (stage.k or stage.capacity) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not stage.k and stage.capacity == 0  # released while idle
        engine.flush_cache()
        again = [o.token_ids for o in engine.generate_sync(
            input_ids=prompts(6), max_new_tokens=12, temperature=0)]
        assert again == first
        assert_clean(engine)
    finally:
        engine.close()
