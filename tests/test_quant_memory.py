"""Lean CPU memory: the KV pool takes memory only as slots are written (kv_pool.py), the
decode stage follows what the running batch holds (attention/decode_stage.py), and
engine.stats() reports the memory figures."""

from __future__ import annotations

import pytest
import torch
from test_decode_stage import Pair

from sgl.backend.attention.decode_stage import HELD_FACTOR, MIN_POSITIONS
from sgl.backend.kv_pool import KVPool


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_cpu_pool_reserves_address_space_not_memory() -> None:
    before = resident_bytes()
    pool = KVPool(1 << 16, num_layers=16, num_kv_heads=4, head_dim=64, dtype=torch.float32,
                  device="cpu", page_size=16)
    assert pool.reserved_bytes >= 1 << 30  # 1 GiB of capacity ...
    assert resident_bytes() - before < 64 << 20  # ... and next to no memory
    assert pool.touched_bytes == 16 * pool.bytes_per_slot  # page 0 only
    assert all(bool((b[:64] == 0).all()) for b in pool.k_buffer + pool.v_buffer)
    slots = pool.allocator.alloc_extend([-1, -1], [40, 8])  # 3 + 1 pages
    assert slots is not None
    for layer in range(16):
        pool.k_buffer[layer][slots] = 1.0
        pool.v_buffer[layer][slots] = 1.0
    assert pool.touched_bytes == 5 * 16 * pool.bytes_per_slot
    assert resident_bytes() - before < 64 << 20
    pool.allocator.free(slots)  # freed pages are reused first: the high-water mark holds
    again = pool.allocator.alloc_extend([-1], [48])
    assert again is not None and pool.touched_bytes == 5 * 16 * pool.bytes_per_slot


def stage_bound(held: int, budget: int) -> int:
    return min(budget, max(HELD_FACTOR * held, MIN_POSITIONS))


def test_decode_stage_stays_within_what_the_batch_holds() -> None:
    pair = Pair(stage_positions=1 << 16, num_slots=8192)
    prompts = {row: 600 + 10 * row for row in range(1, 9)}
    pair.step(prompts)
    pair.decode(list(prompts), times=2)
    stage = pair.staged.stage
    assert stage is not None and len(stage.row_of) == 8
    held = sum(pair.lens.values())
    assert stage.positions <= stage_bound(held, 1 << 16)
    # Most requests leave: once the stage is over twice the bound it is rebuilt smaller.
    for row in range(3, 9):
        pair.leave(row)
    pair.decode([1, 2], times=2)
    held = sum(pair.lens.values())
    assert stage.positions <= stage_bound(held, 1 << 16)


def test_uneven_batch_gathers_and_frees_the_stage() -> None:
    pair = Pair(stage_positions=1 << 16, num_slots=8192)
    pair.step({1: 900, 2: 5, 3: 5, 4: 5, 5: 5})
    pair.decode([1, 2, 3, 4, 5], times=2)  # padded 5 x 902 > 2 x 922 held: no stage
    stage = pair.staged.stage
    assert stage is not None and stage.positions == 0 and not stage.k


@pytest.mark.anyio
@pytest.mark.parametrize("kernels", ["auto", "reference"])
async def test_engine_stats_report_memory(kernels: str) -> None:
    """"auto" (with the C library) attends in place from the pool: no stage at all;
    "reference" batches decode keys through the stage, which stats report."""
    import sgl
    from sgl.backend.quant import cpu_ops

    async with sgl.Engine("smollm2-135m", load_format="dummy", device="cpu",
                          model_config={"num_hidden_layers": 2, "vocab_size": 512},
                          max_total_tokens=100_000, page_size=16, kernels=kernels) as engine:
        idle = engine.stats()
        busy, seen = None, 0
        # Two samples: a lone request reads its keys in place, a batch goes through the stage.
        async for chunk in engine.stream([5, 6, 7, 8], max_new_tokens=16, n=2, temperature=0,
                                         ignore_eos=True):
            seen += len(chunk.token_ids)
            if busy is None and seen >= 8:
                busy = engine.stats()  # mid-decode: the request holds KV and a stage row
    assert busy is not None
    assert idle.weights_bytes > 0 and idle.kv_bytes_per_token == 2 * 2 * 3 * 64 * 2  # float16
    assert idle.kv_bytes_reserved >= 100_000 * idle.kv_bytes_per_token
    assert idle.kv_bytes_touched < idle.kv_bytes_reserved // 100  # grows on demand
    assert busy.kv_bytes_used > 0 and busy.kv_bytes_touched >= busy.kv_bytes_used
    if kernels == "auto" and cpu_ops.available():
        assert busy.decode_stage_bytes == 0
    else:
        assert busy.decode_stage_bytes > 0
    assert busy.peak_rss_bytes >= busy.rss_bytes > 0
