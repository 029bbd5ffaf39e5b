"""The engine on a CUDA device: CUDA-graph decode, GPU vs CPU greedy, no host sync in a step.

Marked `gpu`: skipped where there is no CUDA device (conftest.py). Tiny random-weight Llama
models in float32, so that GPU and CPU agree token for token (fp32 matmuls without TF32 and
the Triton kernels' IEEE fp32 dots differ from the CPU only in summation order).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import torch

import sgl

pytestmark = pytest.mark.gpu

TINY = dict(
    hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=256, vocab_size=512, max_position_embeddings=2048, eos_token_id=0,
)  # fmt: skip
GREEDY = dict(temperature=0, ignore_eos=True)


def engine(device: str, **options: Any) -> sgl.Engine:
    opts: dict[str, Any] = dict(model_config=TINY, load_format="dummy", device=device,
                                dtype="float32", max_total_tokens=16384, max_running_requests=16)
    opts.update(options)
    return sgl.Engine(**opts)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(rng.randint(4, 120))] for _ in range(n)]


def copy_weights(src: sgl.Engine, dst: sgl.Engine) -> None:
    """Dummy weights come from each device's own RNG: give both engines the same values
    (a CPU engine's linear weights are packed for oneDNN: unpacked_state_dict)."""
    # Imported here: importing sgl.backend at collection time would import triton compiled
    # before tests/triton_interp.py can ask for its interpreter (see that module).
    from sgl.backend.layers.linear import unpacked_state_dict

    state = {k: v.to(dst._rt.device)
             for k, v in unpacked_state_dict(src._rt.runner.model).items()}
    dst._rt.runner.model.load_state_dict(state)


async def staggered(e: sgl.Engine, ps: list[list[int]]) -> list[list[int]]:
    # Different lengths, so decode batches shrink step by step through many graph sizes.
    outs = await asyncio.gather(*(e.generate(input_ids=p, max_new_tokens=4 + 3 * i, **GREEDY)
                                  for i, p in enumerate(ps)))
    return [o.token_ids for o in outs]


def test_graph_replay_equals_eager_decode() -> None:
    ps = prompts(13)
    eager = engine("cuda", disable_cuda_graph=True)
    graphs = engine("cuda")
    try:
        assert graphs._rt.cuda_graph_sizes, "no decode graphs were captured"
        copy_weights(eager, graphs)
        used: list[int | None] = []
        runner = graphs._rt.runner
        execute = runner._execute
        runner._execute = lambda step: (used.append(step.graph_bs), execute(step))[1]
        expected = asyncio.run(staggered(eager, ps))
        got = asyncio.run(staggered(graphs, ps))
        assert got == expected
        assert len({bs for bs in used if bs}) >= 3, used  # several padded sizes replayed
        graphs.check_integrity()
    finally:
        eager.close()
        graphs.close()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_gpu_greedy_equals_cpu(overlap: bool) -> None:
    ps = prompts(12, seed=1)
    cpu = engine("cpu", disable_overlap_schedule=True)
    gpu = engine("cuda", disable_overlap_schedule=not overlap)
    try:
        copy_weights(cpu, gpu)
        assert asyncio.run(staggered(gpu, ps)) == asyncio.run(staggered(cpu, ps))
    finally:
        cpu.close()
        gpu.close()


def test_no_host_sync_inside_a_step() -> None:
    """Every step (extend, graph decode, eager decode) only enqueues work on the device."""
    e = engine("cuda", cuda_graph_max_bs=2)  # graphs of up to 4 token rows: 5+ decode eagerly
    runner = e._rt.runner
    execute = runner._execute
    steps: list[Any] = []

    def strict(step: Any) -> Any:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return execute(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            steps.append((step.mode.name, step.graph_bs))

    try:
        asyncio.run(staggered(e, prompts(3)))  # warm up: compile kernels, pin host blocks
        runner._execute = strict
        out = asyncio.run(staggered(e, prompts(8, seed=2)))
        assert all(len(o) == 4 + 3 * i for i, o in enumerate(out))
        kinds = {(m, bs is not None) for m, bs in steps}
        assert {("EXTEND", False), ("DECODE", True), ("DECODE", False)} <= kinds, kinds
    finally:
        runner._execute = execute
        e.close()


def test_kv_pool_sized_from_free_memory() -> None:
    e = sgl.Engine(model_config=TINY, load_format="dummy", device="cuda", mem_fraction_static=0.3)
    try:
        free, _ = torch.cuda.mem_get_info()
        pool_bytes = e.stats().kv_total_tokens * e._rt.model_config.kv_bytes_per_token(e._rt.dtype)
        # 30% of what was free went to the pool: pool / (pool + still free) is about 0.3
        assert 0.25 < pool_bytes / (pool_bytes + free) < 0.35
    finally:
        e.close()
