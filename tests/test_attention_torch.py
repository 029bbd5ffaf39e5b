"""TorchAttentionBackend against a naive per-request, per-head reference.

Also home of the small ForwardBatch builder and stand-in KV pool that test_models.py reuses.
Pool slots are handed out in shuffled order so any indexing mistake shows up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from sgl.backend.attention.torch_backend import TorchAttentionBackend, _FusedDecodeRows
from sgl.backend.forward_batch import ForwardBatch, ForwardMode
from sgl.backend.kernels.attention_decode import decode_attention_reference
from sgl.backend.kernels.attention_extend import extend_attention_reference
from sgl.backend.quant import cpu_ops

# The backend's fused CPU path (cpu_ops.c decode attention and KV store) where it builds.
FUSED = [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu_ops.available(), reason="no C compiler or no AVX2/FMA"))]


class FakePool:
    """Duck-typed KV pool: per-layer buffers, a req_to_token table and a shuffled free list."""

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int,
                 *, dtype: torch.dtype = torch.float32, max_reqs: int = 16,
                 max_context: int = 512, seed: int = 0) -> None:
        shape = (num_slots, kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.req_to_token = torch.zeros(max_reqs, max_context, dtype=torch.int32)
        gen = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(num_slots - 1, generator=gen) + 1).tolist()  # slot 0 reserved

    def alloc(self, n: int) -> torch.Tensor:
        slots, self.free = self.free[:n], self.free[n:]
        return torch.tensor(slots, dtype=torch.int64)


@dataclass
class Step:
    """One request's part of a step: its pool row, tokens already cached, new token ids."""

    pool_index: int
    prefix_len: int
    new_ids: list[int]


def make_forward_batch(pool: FakePool, backend: Any, steps: list[Step], mode: ForwardMode,
                       device: torch.device | str = "cpu") -> ForwardBatch:
    """Allocate slots for the new tokens, fill every ForwardBatch field, run prepare().

    `device`: where the batch tensors live (the pool's buffers must already be there).
    """
    ids, positions, locs, starts = [], [], [], []
    for step in steps:
        n = len(step.new_ids)
        slots = pool.alloc(n).to(device)
        pool.req_to_token[step.pool_index, step.prefix_len : step.prefix_len + n] = slots.int()
        starts.append(len(ids))
        ids += step.new_ids
        positions += range(step.prefix_len, step.prefix_len + n)
        locs.append(slots)
    prefix = [s.prefix_len for s in steps]
    new = [len(s.new_ids) for s in steps]
    seq = [p + n for p, n in zip(prefix, new)]
    ends = [s + n - 1 for s, n in zip(starts, new)]

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    fb = ForwardBatch(
        mode=mode, batch_size=len(steps), input_ids=t(ids), positions=t(positions),
        out_cache_loc=torch.cat(locs), req_pool_indices=t([s.pool_index for s in steps]),
        seq_lens=t(seq), extend_prefix_lens=t(prefix), extend_seq_lens=t(new),
        extend_start=t(starts), seq_lens_cpu=seq, extend_prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=new, logits_indices=t(ends), req_to_token=pool.req_to_token,
        kv_pool=pool, attn_backend=backend,  # type: ignore[arg-type]
    )
    backend.prepare(fb)
    return fb


def naive_attention(q: torch.Tensor, k_seq: torch.Tensor, v_seq: torch.Tensor,
                    prefix: int, scale: float) -> torch.Tensor:
    """One request, loops over queries and heads. q [n, H, d]; k_seq/v_seq [L, Hkv, d]."""
    n, heads, _ = q.shape
    group = heads // k_seq.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(n):
        visible = prefix + i + 1  # causal: position prefix + i sees keys 0 .. prefix + i
        for h in range(heads):
            keys = k_seq[:visible, h // group].double()  # [visible, d]
            scores = keys @ q[i, h].double() * scale  # [visible]
            out[i, h] = torch.softmax(scores, 0) @ v_seq[:visible, h // group].double()
    return out


def _run_case(prefix_lens: list[int], new_lens: list[int], heads: int, kv_heads: int,
              mode: ForwardMode, dtype: torch.dtype = torch.float32, fused: bool = False,
              head_dim: int = 16, kv_dtype: torch.dtype | None = None) -> None:
    """`kv_dtype`: the pool's dtype when it differs from the model's (`dtype`)."""
    torch.manual_seed(0)
    layer = 1
    kv_dtype = kv_dtype or dtype
    total, longest = sum(prefix_lens) + sum(new_lens), max(map(sum, zip(prefix_lens, new_lens)))
    pool = FakePool(2, max(1024, 2 * total), kv_heads, head_dim, dtype=kv_dtype,
                    max_context=max(512, longest + 1))
    backend = TorchAttentionBackend(fused_cpu=fused)
    assert backend.fused_cpu == (fused and cpu_ops.likely_available())
    # Fill each request's prefix KV directly in the pool (as an earlier step would have).
    seqs_k, seqs_v, steps = [], [], []
    for b, (prefix, n) in enumerate(zip(prefix_lens, new_lens)):
        slots = pool.alloc(prefix)
        pool.req_to_token[b + 1, :prefix] = slots.int()
        kp = torch.randn(prefix, kv_heads, head_dim).to(kv_dtype)
        vp = torch.randn(prefix, kv_heads, head_dim).to(kv_dtype)
        pool.k_buffer[layer][slots], pool.v_buffer[layer][slots] = kp, vp
        seqs_k.append(kp)
        seqs_v.append(vp)
        steps.append(Step(b + 1, prefix, [0] * n))
    fb = make_forward_batch(pool, backend, steps, mode)
    tokens = fb.num_tokens
    q = torch.randn(tokens, heads, head_dim).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    out = backend.forward(q, k, v, layer, scale, fb)
    assert out.shape == q.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b, (prefix, n) in enumerate(zip(prefix_lens, new_lens)):
        rows = slice(int(fb.extend_start[b]), int(fb.extend_start[b]) + n)
        k_seq = torch.cat([seqs_k[b], k[rows].to(kv_dtype)])  # (as stored: rounded)
        v_seq = torch.cat([seqs_v[b], v[rows].to(kv_dtype)])
        expected = naive_attention(q[rows], k_seq, v_seq, prefix, scale)
        torch.testing.assert_close(out[rows].double(), expected, atol=tol, rtol=tol)
    # The new k/v landed in the pool at out_cache_loc.
    assert torch.equal(pool.k_buffer[layer][fb.out_cache_loc], k.to(kv_dtype))
    assert torch.equal(pool.v_buffer[layer][fb.out_cache_loc], v.to(kv_dtype))
    # And the output is the kernels' torch references' (what the Triton kernels are tested
    # against) on the same pool: one reference for attention, batched here through SDPA.
    kb, vb = pool.k_buffer[layer], pool.v_buffer[layer]
    table = (fb.req_to_token, fb.req_pool_indices, fb.seq_lens)
    expected = extend_attention_reference(q, kb, vb, *table, fb.extend_prefix_lens,
                                          fb.extend_seq_lens, fb.extend_start, scale)
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    if mode is ForwardMode.DECODE:
        torch.testing.assert_close(out, decode_attention_reference(q, kb, vb, *table, scale),
                                   atol=tol, rtol=tol)
    assert pool.k_buffer[0].abs().sum() == 0  # other layers untouched


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_decode_ragged_batch(heads: int, kv_heads: int, fused: bool) -> None:
    _run_case([5, 0, 17, 1, 40], [1, 1, 1, 1, 1], heads, kv_heads, ForwardMode.DECODE,
              fused=fused)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("head_dim", [64, 20])  # 20: the C loops' tails past 8-wide vectors
def test_decode_long_keys_across_threads(head_dim: int, fused: bool) -> None:
    # Enough keys that the fused kernel splits (request, KV head) tasks over threads.
    _run_case([700, 3, 1500, 260], [1, 1, 1, 1], 9, 3, ForwardMode.DECODE, fused=fused,
              head_dim=head_dim)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_extend_without_prefix(heads: int, kv_heads: int, fused: bool) -> None:
    _run_case([0, 0, 0], [7, 1, 12], heads, kv_heads, ForwardMode.EXTEND, fused=fused)


@pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler or no AVX2/FMA")
def test_fused_path_attends_prompt_tokens_as_query_rows_of_the_c_op(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On the fused CPU path a prompt chunk's tokens are query rows of the C op, token i of a
    request with p cached tokens seeing its first p + i + 1 keys; SDPA (the per-request extend
    path) is not called. (Both give the right values: only this test tells them apart.)"""
    def sdpa_extend(*args: Any) -> None:
        raise AssertionError("a prompt chunk took the SDPA extend path")

    monkeypatch.setattr(TorchAttentionBackend, "_attend_extend", staticmethod(sdpa_extend))
    pool = FakePool(2, 256, 2, 16)
    backend = TorchAttentionBackend(fused_cpu=True)
    steps = [Step(1, 9, [0] * 3), Step(2, 0, [0] * 2), Step(3, 30, [0])]
    for step in steps:
        pool.req_to_token[step.pool_index, :step.prefix_len] = pool.alloc(step.prefix_len).int()
    fb = make_forward_batch(pool, backend, steps, ForwardMode.EXTEND)
    meta = fb.attn_metadata
    assert meta.extends == [] and isinstance(meta.decode, _FusedDecodeRows)  # all rows, in order
    assert meta.decode.lens.tolist() == [10, 11, 12, 1, 2, 31]
    assert meta.decode.table_rows.tolist() == [1, 1, 1, 2, 2, 3]
    assert backend.fused_decode_rows(fb) is None  # (an EXTEND step: not the one-call step's)
    _run_case([9, 0, 30, 4, 0], [6, 5, 1, 1, 3], 6, 2, ForwardMode.EXTEND, fused=True)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_extend_with_prefix_and_decode_rows(heads: int, kv_heads: int, fused: bool) -> None:
    # Chunked-prefill continuation, a fresh prompt, and decode rows riding along.
    _run_case([9, 0, 30, 4, 0], [6, 5, 1, 1, 3], heads, kv_heads, ForwardMode.EXTEND,
              fused=fused)


@pytest.mark.parametrize("fused", [False, True])  # fused: a bfloat16 pool falls back to SDPA
def test_bfloat16_decode_and_extend(fused: bool) -> None:
    _run_case([3, 20], [1, 1], 6, 2, ForwardMode.DECODE, torch.bfloat16, fused=fused)
    _run_case([3, 0, 20], [4, 6, 1], 6, 2, ForwardMode.EXTEND, torch.bfloat16, fused=fused)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fused", FUSED)
def test_16_bit_pool_under_float32_queries(kv_dtype: torch.dtype, fused: bool) -> None:
    """kv_cache_dtype on the CPU: K/V stored rounded to 16 bits, read widened (exact), so
    attention over the stored values keeps float32's tolerance on every path (the fused C
    ops, SDPA over gathered keys, extend)."""
    for mode, prefixes, news in ((ForwardMode.DECODE, [5, 0, 17, 40], [1, 1, 1, 1]),
                                 (ForwardMode.EXTEND, [9, 0, 30, 4], [6, 5, 1, 1])):
        _run_case(prefixes, news, 6, 2, mode, fused=fused, head_dim=64, kv_dtype=kv_dtype)


def test_prepare_metadata_is_reused_across_layers() -> None:
    # Two layers through one prepare(): each writes its own buffer and reads only its own.
    pool = FakePool(2, 64, 2, 8)
    backend = TorchAttentionBackend()
    fb = make_forward_batch(pool, backend, [Step(1, 0, [0, 0, 0])], ForwardMode.EXTEND)
    meta = fb.attn_metadata
    q = torch.randn(3, 2, 8)
    kv = [torch.randn(3, 2, 8) for _ in range(2)]
    outs = [backend.forward(q, kv[i], kv[i], i, 0.3, fb) for i in range(2)]
    assert fb.attn_metadata is meta
    assert not torch.allclose(outs[0], outs[1])
    torch.testing.assert_close(pool.k_buffer[1][fb.out_cache_loc], kv[1])
