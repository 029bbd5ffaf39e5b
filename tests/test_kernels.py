"""Every kernel against its pure-torch reference, parametrized over implementations.

Without CUDA the Triton kernels run under Triton's interpreter, set up by tests/triton_interp.py
(imported first, before triton): in process when this module is the first to import triton;
otherwise the in-process Triton tests skip and `test_triton_kernels_in_subprocess` reruns this
file with TRITON_INTERPRET=1 from the start.

`expected` values come from the reference evaluated on fp32 copies of the inputs; each
implementation, given the test dtype, must land within that dtype's tolerance. The references
themselves are checked against independent formulas (SDPA, HF rotate_half) here and against
transformers' modules bit for bit in tests/test_kernels_reference.py. The `kernel_set` tests
run every op as the engine does, through the Triton and the reference KernelSet.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from triton_interp import (  # first: sets TRITON_INTERPRET before triton is imported
    CUDA,
    DEVICE,
    NO_TRITON,
    rerun_interpreted,
    skip_unless_rerun_needed,
    triton_runs_here,
)

from sgl.backend.attention.triton_backend import TritonAttentionBackend
from sgl.backend.forward_batch import ForwardBatch, ForwardMode
from sgl.backend.kernels import (
    activation,
    argmax,
    attention_decode,
    attention_extend,
    dispatch,
    kv_store,
    rmsnorm,
    rotary,
    token_bitmask,
    triton_attention_decode,
    triton_compat,
    triton_rmsnorm,
    triton_rotary,
)
from sgl.errors import InvalidConfigError

TRITON_HERE = triton_runs_here(triton_attention_decode._decode_stage1)
needs_triton = pytest.mark.skipif(not TRITON_HERE, reason=NO_TRITON)
IMPLS = ["reference", "triton"]
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
FP8 = torch.float8_e4m3fn  # kv_cache_dtype="fp8_e4m3"
# Triton's interpreter rounds float -> float8 casts wrongly (triton 3.9: 0.1249 -> 0.0625,
# subnormals flushed to 0), so the Triton float8 *stores* are checked on CUDA only; it widens
# every finite float8 code exactly, so the attention kernels over a float8 pool run everywhere.
FP8_STORE_ON_CUDA = "float8 stores: Triton's interpreter rounds them wrongly (CUDA only)"


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> str:
    if request.param == "triton" and not TRITON_HERE:
        pytest.skip(NO_TRITON)
    return request.param


def op(module: Any, name: str, impl: str) -> Callable[..., Any]:
    """`<name>_<impl>`: the reference from the op's module, the Triton kernel from the
    `triton_<module>` beside it."""
    if impl == "triton":
        module = importlib.import_module(module.__name__.replace(".kernels.", ".kernels.triton_"))
    return getattr(module, f"{name}_{impl}")


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def randn(*shape: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


# --------------------------------------------------------------------------- pointwise ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 200), (3, 5, 96)])
def test_rmsnorm(impl: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = gen(0)
    x, r = randn(*shape, dtype=dtype, g=g), randn(*shape, dtype=dtype, g=g)
    w = randn(shape[-1], dtype=dtype, g=g)
    close(op(rmsnorm, "rmsnorm", impl)(x, w, 1e-6),
          rmsnorm.rmsnorm_reference(x.float(), w.float(), 1e-6), dtype)
    normed, summed = op(rmsnorm, "fused_add_rmsnorm", impl)(x, r, w, 1e-6)
    exp_normed, exp_summed = rmsnorm.fused_add_rmsnorm_reference(x.float(), r.float(), w.float())
    close(summed, exp_summed, dtype)
    close(normed, exp_normed, dtype)
    assert normed.shape == summed.shape == x.shape and normed.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 64), (9, 300), (4, 1100)])
def test_silu_and_mul(impl: str, dtype: torch.dtype, tokens: int, inter: int) -> None:
    x = randn(tokens, 2 * inter, dtype=dtype, g=gen(3))
    out = op(activation, "silu_and_mul", impl)(x)
    assert out.shape == (tokens, inter)
    close(out, F.silu(x.float()[:, :inter]) * x.float()[:, inter:], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 4096, 9000])  # one slice of the kernel, exactly one, three
def test_argmax_is_torch_argmax_on_ties_nans_zeros_and_masks(impl: str, dtype: torch.dtype,
                                                              vocab: int) -> None:
    """The greedy token: the first index of the row's maximum, a NaN the maximum (the first
    NaN), -0.0 tying +0.0, column 0 for an all -inf row, +inf beating finite values; ties
    across the kernel's slices keep the lower index. int64, as torch.argmax."""
    g = gen(21)
    logits = torch.randn(9, vocab, generator=g).to(dtype)
    last = vocab - 1
    logits[1, 3] = logits[1, last] = 40.0  # a tie: the lower id
    logits[2, last] = logits[2, 1] = float("nan")  # NaN wins, the first one
    logits[3] = float("-inf")  # every token masked: column 0
    logits[4, last] = float("inf")
    logits[5] = float("-inf")
    logits[5, 1] = -0.0  # -0.0 first, then +0.0: they tie, the first wins
    logits[5, last] = 0.0
    logits[6] = -1.0  # all equal: column 0
    logits[7, last] = logits[7, max(0, last - 4096)] = float("inf")  # a tie across slices
    logits = logits.to(DEVICE)
    for view in (logits, logits[1:8], logits[:, : max(1, vocab // 2)]):
        got = op(argmax, "argmax", impl)(view)
        want = view.cpu().float().argmax(dim=-1)
        assert got.dtype == torch.int64 and got.device == view.device
        assert torch.equal(got.cpu(), want), (dtype, vocab, got, want)
    assert op(argmax, "argmax", impl)(logits[:0]).shape == (0,)


def _hf_rotary(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Hugging Face Llama's formula, written independently: x * cos + rotate_half(x) * sin."""
    dim = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    freqs = positions.double().cpu()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1).to(x.device)  # [T, dim]
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return (x.double() * cos + torch.cat([-x2, x1], dim=-1).double() * sin).float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [(4, 4, 32, 32), (6, 2, 64, 64),
                                                                (8, 2, 48, 32)])
@pytest.mark.parametrize("inplace", [False, True])
def test_rotary(impl: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                rotary_dim: int, inplace: bool) -> None:
    g = gen(4)
    tokens = 11
    positions = torch.randint(0, 500, (tokens,), generator=g).to(DEVICE)
    # q, k as views of one fused projection, as a model produces them (strided token axis).
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, g=g)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    cache = rotary.make_cos_sin_cache(512, rotary_dim, 10000.0, device=DEVICE)
    exp_q, exp_k = rotary.rotary_embedding_reference(positions, q.float(), k.float(), cache)
    q_in, k_in = q.clone(), k.clone()
    out_q, out_k = op(rotary, "rotary_embedding", impl)(positions, q, k, cache, inplace)
    close(out_q, exp_q, dtype)
    close(out_k, exp_k, dtype)
    if inplace:
        assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    else:
        assert torch.equal(q, q_in) and torch.equal(k, k_in)
    if rotary_dim == head_dim:
        torch.testing.assert_close(exp_q, _hf_rotary(q_in.float(), positions, 10000.0),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [(4, 4, 32, 32), (6, 2, 64, 64),
                                                                (8, 2, 48, 32)])
def test_rotary_kv_store(impl: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                         rotary_dim: int) -> None:
    """q rotated in place, k rotated into the pool with v, as rotary then kv_store would; k
    itself untouched. (rotary_dim < head_dim: the two kernels, one after the other.)"""
    g = gen(6)
    tokens, slots = 7, 40
    positions = torch.randint(0, 500, (tokens,), generator=g).to(DEVICE)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, g=g)  # fused, strided
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    cache = rotary.make_cos_sin_cache(512, rotary_dim, 10000.0, device=DEVICE, dtype=dtype)
    k_buffer = randn(slots, kv_heads, head_dim, dtype=dtype, g=g)
    v_buffer = randn(slots, kv_heads, head_dim, dtype=dtype, g=g)
    loc = (torch.randperm(slots - 1, generator=g)[:tokens] + 1).to(DEVICE)
    exp_q, exp_k = rotary.rotary_embedding_reference(positions, q.float(), k.float(), cache.float())
    exp_kb, exp_vb = k_buffer.clone(), v_buffer.clone()
    exp_kb[loc], exp_vb[loc] = exp_k.to(dtype), v
    k_in = k.clone()
    out_q = op(rotary, "rotary_kv_store", impl)(positions, q, k, v, cache, k_buffer, v_buffer, loc)
    assert out_q.data_ptr() == q.data_ptr(), "q is rotated in place"
    close(q, exp_q, dtype)
    close(k_buffer, exp_kb, dtype)
    assert torch.equal(v_buffer, exp_vb)
    assert torch.equal(k, k_in), "k itself is left as it was"


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_store(impl: str, dtype: torch.dtype) -> None:
    g = gen(5)
    slots, kv_heads, head_dim, tokens = 64, 3, 48, 9
    k_buffer = randn(slots, kv_heads, head_dim, dtype=dtype, g=g)
    v_buffer = randn(slots, kv_heads, head_dim, dtype=dtype, g=g)
    kv = randn(tokens, 2 * kv_heads * head_dim, dtype=dtype, g=g)  # fused, strided views
    k = kv[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = kv[:, kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    loc = (torch.randperm(slots - 1, generator=g)[:tokens] + 1).to(DEVICE)
    exp_k, exp_v = k_buffer.clone(), v_buffer.clone()
    exp_k[loc], exp_v[loc] = k, v
    op(kv_store, "kv_store", impl)(k_buffer, v_buffer, k, v, loc)
    assert torch.equal(k_buffer, exp_k) and torch.equal(v_buffer, exp_v)


def skip_float8_store_off_cuda(impl: str) -> None:
    if impl == "triton" and not CUDA:
        pytest.skip(FP8_STORE_ON_CUDA)


def float8_edge_values(dtype: torch.dtype) -> torch.Tensor:  # [2 * len(FLOAT8_EDGES)]
    """Values whose e4m3 rounding is easy to get wrong, then their negations (on DEVICE)."""
    values = torch.tensor([x for x, _ in FLOAT8_EDGES], dtype=torch.float64)
    return torch.cat([values, -values]).to(dtype=dtype, device=DEVICE)


FLOAT8_EDGES = [  # (value, its e4m3 rounding), written out
    (1 + 1 / 16, 1.0), (1 + 3 / 16, 1.25), (3 + 1 / 8, 3.0), (0.5 + 1 / 32, 0.5),  # ties
    (2**-10, 0.0), (3 * 2**-10, 2**-8), (5 * 2**-10, 2**-8),  # subnormal ties (step 2^-9)
    (2**-6, 2**-6), (2**-6 - 2**-10, 2**-6), (7 * 2**-9, 7 * 2**-9), (2**-9, 2**-9),
    (2**-11, 0.0), (0.0, 0.0),
    (448.0, 448.0), (449.0, 448.0), (464.0, 448.0), (465.0, 448.0), (480.0, 448.0),
    (1e4, 448.0), (3e38, 448.0), (float("inf"), 448.0),  # saturated
]


def float8_kv(tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              g: torch.Generator) -> torch.Tensor:  # [tokens, kv_heads, head_dim]
    """Random rows at scales from the subnormals to past saturation, the edge values first."""
    n = tokens * kv_heads * head_dim
    edges = float8_edge_values(dtype)
    scales = torch.tensor([1e-3, 0.05, 1.0, 30.0, 600.0])[torch.randint(0, 5, (n,), generator=g)]
    x = (torch.randn(n, generator=g) * scales).to(dtype=dtype, device=DEVICE)
    x[: edges.numel()] = edges
    return x.view(tokens, kv_heads, head_dim)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    a, e = actual.cpu().view(torch.int8), expected.cpu().view(torch.int8)
    bad = (a != e).nonzero()
    assert bad.numel() == 0, (f"{bad.shape[0]} of {a.numel()} codes differ, first at "
                              f"{bad[0].tolist()}: {a[tuple(bad[0])]} vs {e[tuple(bad[0])]}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_store_float8(impl: str, dtype: torch.dtype) -> None:
    """Into a float8 pool: the reference's bits (saturated at +-448, nearest even, once from
    the model's dtype), the edge cases among them; the other slots untouched."""
    skip_float8_store_off_cuda(impl)
    g = gen(16)
    slots, kv_heads, head_dim, tokens = 64, 3, 48, 9
    k_buffer = randn(slots, kv_heads, head_dim, dtype=torch.float32, g=g).to(FP8)
    v_buffer = randn(slots, kv_heads, head_dim, dtype=torch.float32, g=g).to(FP8)
    k = float8_kv(tokens, kv_heads, head_dim, dtype, g)
    v = -float8_kv(tokens, kv_heads, head_dim, dtype, g)
    loc = (torch.randperm(slots - 1, generator=g)[:tokens] + 1).to(DEVICE)
    exp_k, exp_v = k_buffer.cpu(), v_buffer.cpu()  # (expected on the CPU, whatever DEVICE is)
    kv_store.kv_store_reference(exp_k, exp_v, k.cpu(), v.cpu(), loc.cpu())
    op(kv_store, "kv_store", impl)(k_buffer, v_buffer, k, v, loc)
    assert_same_bits(k_buffer, exp_k)
    assert_same_bits(v_buffer, exp_v)
    rounded = torch.tensor([r for _, r in FLOAT8_EDGES])
    stored = k_buffer[loc[0]].flatten()[: 2 * len(FLOAT8_EDGES)].float().cpu()  # token 0's
    assert torch.equal(stored, torch.cat([rounded, -rounded]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [(4, 4, 32, 32), (6, 2, 64, 64),
                                                                (8, 2, 48, 32)])
def test_rotary_kv_store_float8(impl: str, dtype: torch.dtype, heads: int, kv_heads: int,
                                head_dim: int, rotary_dim: int) -> None:
    """Into a float8 pool the rotated k is rounded to the model's dtype, then to float8 (what
    rotary then kv_store give; rotary_dim < head_dim runs the two kernels). In bfloat16 the
    Triton kernel's rotation is exact before that rounding (bf16 x bf16 products fit fp32):
    the codes equal those of the float32 rotation stored by the reference. Otherwise the
    model-dtype k differs by its rounding, so within one e4m3 step."""
    skip_float8_store_off_cuda(impl)
    g = gen(17)
    tokens, slots = 7, 40
    positions = torch.randint(0, 500, (tokens,), generator=g).to(DEVICE)
    q = randn(tokens, heads, head_dim, dtype=dtype, g=g)
    k = float8_kv(tokens, kv_heads, head_dim, dtype, g)
    k = torch.where(k.isinf(), 0.0, k)  # (inf * 0 in a rotation is NaN)
    v = float8_kv(tokens, kv_heads, head_dim, dtype, g)
    cache = rotary.make_cos_sin_cache(512, rotary_dim, 10000.0, device=DEVICE, dtype=dtype)
    k_buffer = torch.zeros(slots, kv_heads, head_dim, device=DEVICE).to(FP8)
    v_buffer = torch.zeros_like(k_buffer)
    loc = (torch.randperm(slots - 1, generator=g)[:tokens] + 1).to(DEVICE)
    exp_q, exp_k = rotary.rotary_embedding_reference(positions, q.float(), k.float(), cache.float())
    exp_kb, exp_vb = k_buffer.cpu(), v_buffer.cpu()
    kv_store.kv_store_reference(exp_kb, exp_vb, exp_k.to(dtype).cpu(), v.cpu(), loc.cpu())
    op(rotary, "rotary_kv_store", impl)(positions, q, k, v, cache, k_buffer, v_buffer, loc)
    close(q, exp_q, dtype)
    assert_same_bits(v_buffer, exp_vb)
    if impl == "triton" and dtype == torch.bfloat16:
        assert_same_bits(k_buffer, exp_kb)
    # Otherwise the model-dtype k may differ from the float32 rotation's rounding: the
    # reference rotates op by op in the model's dtype, each product and the sum rounded (at
    # most eps * (|k1| + |k2|) apart, large under cancellation); the stored code is then
    # within that, plus one e4m3 step at |want|, of the expected one.
    got, want = k_buffer.cpu().float(), exp_kb.float()
    half = rotary_dim // 2
    pair = k.float().abs().cpu()
    pair[..., :rotary_dim] = pair[..., :half].repeat(1, 1, 2) + pair[..., half:rotary_dim].repeat(1, 1, 2)
    pair[..., rotary_dim:] = 0
    drift = torch.zeros_like(want)
    drift[loc.cpu()] = 2 * torch.finfo(dtype).eps * pair
    step = torch.maximum(want.abs() / 8, torch.tensor(2.0**-9))  # e4m3's spacing at |want|
    assert ((got - want).abs() <= step + drift).all(), (got - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,words,use_indices", [(100, 4, False), (100, 4, True),
                                                      (4500, 141, False), (70, 3, True)])
def test_token_bitmask(impl: str, dtype: torch.dtype, vocab: int, words: int,
                       use_indices: bool) -> None:
    check_token_bitmask(op(token_bitmask, "apply_token_bitmask", impl), DEVICE, dtype, vocab,
                        words, use_indices)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,words,use_indices", [(100, 4, False), (4500, 141, True)])
def test_token_bitmask_xgrammar_on_cpu(dtype: torch.dtype, vocab: int, words: int,
                                       use_indices: bool) -> None:
    pytest.importorskip("xgrammar")
    check_token_bitmask(token_bitmask.apply_token_bitmask_xgrammar, "cpu", dtype, vocab, words,
                        use_indices)


def check_token_bitmask(fn: Callable[..., Any], device: str, dtype: torch.dtype, vocab: int,
                        words: int, use_indices: bool) -> None:
    g = gen(6)
    rows = 5
    logits = torch.randn(rows, vocab, generator=g).to(device, dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g,
                            dtype=torch.int32).to(device)
    indices = torch.tensor([4, 1], device=device) if use_indices else None
    expected = logits.clone()
    width = min(vocab, 32 * words)
    for r in (indices.tolist() if indices is not None else range(rows)):
        for t in range(width):  # the bit rule, written out
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    fn(logits, bitmask, indices)
    assert torch.equal(logits, expected)


# --------------------------------------------------------------------------- attention


def make_pool(seq_lens: list[int], kv_heads: int, head_dim: int, page_size: int,
              dtype: torch.dtype, g: torch.Generator) -> SimpleNamespace:
    """A shuffled paged pool: each request's pages are scattered (page 0 reserved), and the
    requests sit at shuffled rows of req_to_token, so every index is exercised."""
    pages = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages) + 3  # + reserved page 0 + spare pages never used
    order = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    max_reqs, max_ctx = len(seq_lens) + 2, max(max(seq_lens), 1) + 5
    req_to_token = torch.zeros(max_reqs, max_ctx, dtype=torch.int32)
    rows = (torch.randperm(max_reqs - 1, generator=g)[: len(seq_lens)] + 1)
    for b, n in enumerate(seq_lens):
        mine, order = order[: pages[b]], order[pages[b] :]
        slots = [p * page_size + i for p in mine for i in range(page_size)][:n]
        req_to_token[rows[b], :n] = torch.tensor(slots, dtype=torch.int32)
    num_slots = num_pages * page_size
    return SimpleNamespace(
        k=randn(num_slots, kv_heads, head_dim, dtype=dtype, g=g),
        v=randn(num_slots, kv_heads, head_dim, dtype=dtype, g=g),
        req_to_token=req_to_token.to(DEVICE),
        rows=rows.to(DEVICE),
    )


def sdpa_attention(q: torch.Tensor, pool: SimpleNamespace, seq_lens: list[int],
                   prefix_lens: list[int], ext_lens: list[int]) -> torch.Tensor:
    """Independent check of the references: dense gather + SDPA with an explicit mask."""
    group = q.shape[1] // pool.k.shape[1]
    out, start = torch.zeros_like(q, dtype=torch.float32), 0
    for b, (n, prefix, length) in enumerate(zip(ext_lens, prefix_lens, seq_lens)):
        slots = pool.req_to_token[pool.rows[b], :length].long()
        k = pool.k[slots].float().repeat_interleave(group, 1).transpose(0, 1)  # [H, L, D]
        v = pool.v[slots].float().repeat_interleave(group, 1).transpose(0, 1)
        qb = q[start : start + n].float().transpose(0, 1)  # [H, n, D]
        mask = torch.arange(length)[None, :] <= (prefix + torch.arange(n))[:, None]
        if n and length:
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask.to(DEVICE))
            out[start : start + n] = o.transpose(0, 1)
        start += n
    return out


GQA = [(4, 4, 32), (6, 2, 48), (8, 2, 64)]  # (heads, kv_heads, head_dim): ratios 1, 3, 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", GQA)
@pytest.mark.parametrize("page_size,num_kv_splits", [(1, 4), (16, 1), (16, 3)])
def test_decode_attention(impl: str, dtype: torch.dtype, heads: int, kv_heads: int,
                          head_dim: int, page_size: int, num_kv_splits: int) -> None:
    g = gen(7)
    seq_lens = [1, 37, 200, 0, 129]  # 0: a padded CUDA-graph row (output must be 0, not NaN)
    pool = make_pool(seq_lens, kv_heads, head_dim, page_size, dtype, g)
    q = randn(len(seq_lens), heads, head_dim, dtype=dtype, g=g)
    lens = torch.tensor(seq_lens, device=DEVICE)
    scale = head_dim**-0.5
    args = (pool.req_to_token, pool.rows, lens, scale, num_kv_splits)
    expected = attention_decode.decode_attention_reference(q.float(), pool.k.float(),
                                                           pool.v.float(), *args)
    out = op(attention_decode, "decode_attention", impl)(q, pool.k, pool.v, *args)
    assert out.shape == (len(seq_lens), heads, head_dim) and out.dtype == dtype
    close(out, expected, dtype)
    if dtype == torch.float32 and impl == "reference":
        dense = sdpa_attention(q, pool, seq_lens, [n - 1 for n in seq_lens], [1] * len(seq_lens))
        torch.testing.assert_close(expected, dense, atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", GQA)
@pytest.mark.parametrize("num_kv_splits", [2, 5, 32])
def test_decode_attention_merge_in_stage1_equals_stage2(dtype: torch.dtype, heads: int,
                                                       kv_heads: int, head_dim: int,
                                                       num_kv_splits: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The splits merged by the last program of stage 1 (one launch) and by stage 2's kernel
    agree within the dtype's tolerance, and the last program puts every counter back to 0:
    two launches in a row (as layers do) give the same bits."""
    g = gen(19)
    seq_lens = [1, 37, 200, 0, 129, 64, 2000]
    pool = make_pool(seq_lens, kv_heads, head_dim, 16, dtype, g)
    q = randn(len(seq_lens), heads, head_dim, dtype=dtype, g=g)
    args = (q, pool.k, pool.v, pool.req_to_token, pool.rows,
            torch.tensor(seq_lens, device=DEVICE), head_dim**-0.5, num_kv_splits)
    monkeypatch.setattr(triton_attention_decode, "MERGE_IN_STAGE1", [False])
    two_launches = triton_attention_decode.decode_attention_triton(*args)
    monkeypatch.setattr(triton_attention_decode, "MERGE_IN_STAGE1", [True])
    one = triton_attention_decode.decode_attention_triton(*args)
    counters = triton_compat.tile_counters(one.device, len(seq_lens) * kv_heads)
    assert not counters.any(), "a counter left non-zero"
    again = triton_attention_decode.decode_attention_triton(*args)
    assert not counters.any()
    assert torch.equal(one, again)
    close(one, two_launches, dtype)
    expected = attention_decode.decode_attention_reference(q.float(), pool.k.float(),
                                                           pool.v.float(), *args[3:])
    close(one, expected, dtype)


@needs_triton
@pytest.mark.parametrize("num_kv_splits", [1, 5])
def test_step_inputs_read_before_the_wait_change_no_bit(num_kv_splits: int) -> None:
    """triton_compat.INPUTS_FIRST only moves reads (and, compiled and launched early, adds an
    L2 prefetch): decode attention and rotary + KV store give the same bits with it on and off."""
    g = gen(23)
    heads, kv_heads, head_dim, tokens = 8, 2, 64, 5
    seq_lens = [1, 37, 200, 0, 129]
    pool = make_pool(seq_lens, kv_heads, head_dim, 16, torch.bfloat16, g)
    q = randn(tokens, heads, head_dim, dtype=torch.bfloat16, g=g)
    positions = torch.randint(0, 500, (tokens,), generator=g).to(DEVICE)
    k = randn(tokens, kv_heads, head_dim, dtype=torch.bfloat16, g=g)
    v = randn(tokens, kv_heads, head_dim, dtype=torch.bfloat16, g=g)
    cache = rotary.make_cos_sin_cache(512, head_dim, 10000.0, device=DEVICE, dtype=torch.bfloat16)
    loc = (torch.randperm(pool.k.shape[0] - 1, generator=g)[:tokens] + 1).to(DEVICE)
    results, shipped = [], triton_compat.INPUTS_FIRST[0]
    try:
        for first in (True, False):
            triton_compat.INPUTS_FIRST[0] = first  # (read at each launch)
            q_out, k_buffer, v_buffer = q.clone(), pool.k.clone(), pool.v.clone()
            triton_rotary.rotary_kv_store_triton(positions, q_out, k, v, cache, k_buffer,
                                                 v_buffer, loc)
            out = triton_attention_decode.decode_attention_triton(
                q_out, k_buffer, v_buffer, pool.req_to_token, pool.rows,
                torch.tensor(seq_lens, device=DEVICE), head_dim**-0.5, num_kv_splits)
            results.append((q_out, k_buffer, v_buffer, out))
    finally:
        triton_compat.INPUTS_FIRST[0] = shipped
    for on, off in zip(*results):
        assert torch.equal(on, off)


def float8_pool(pool: SimpleNamespace) -> SimpleNamespace:
    """The pool stored as float8 (the reference's rounding), and as those values widened."""
    k, v = kv_store.to_pool_dtype(pool.k, FP8), kv_store.to_pool_dtype(pool.v, FP8)
    return SimpleNamespace(**{**vars(pool), "k": k, "v": v, "k_wide": k.float(),
                              "v_wide": v.float()})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", GQA[1:])
@pytest.mark.parametrize("page_size,num_kv_splits", [(1, 4), (16, 1)])
def test_decode_attention_float8_pool(impl: str, dtype: torch.dtype, heads: int, kv_heads: int,
                                      head_dim: int, page_size: int, num_kv_splits: int) -> None:
    """Over a float8 pool (q in the model's dtype): the reference over the same pool widened,
    at the model dtype's tolerance (the kernels widen each tile to q's dtype as it loads)."""
    g = gen(18)
    seq_lens = [1, 37, 200, 0, 129]
    pool = float8_pool(make_pool(seq_lens, kv_heads, head_dim, page_size, torch.float32, g))
    q = randn(len(seq_lens), heads, head_dim, dtype=dtype, g=g)
    args = (pool.req_to_token, pool.rows, torch.tensor(seq_lens, device=DEVICE),
            head_dim**-0.5, num_kv_splits)
    expected = attention_decode.decode_attention_reference(q.float(), pool.k_wide, pool.v_wide,
                                                           *args)
    out = op(attention_decode, "decode_attention", impl)(q, pool.k, pool.v, *args)
    assert out.shape == (len(seq_lens), heads, head_dim) and out.dtype == dtype
    close(out, expected, dtype)


EXTEND_CASES = {  # (page_size, prefix_lens, extend_lens)
    "no_prefix": (1, [0, 0, 0], [70, 1, 17]),
    "prefix": (16, [33, 100, 5], [40, 3, 64]),
    "mixed_decode_rows": (16, [0, 150, 12, 64], [65, 1, 1, 30]),
    "prefix_page1": (1, [20, 7], [33, 2]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", GQA)
@pytest.mark.parametrize("case", list(EXTEND_CASES))
def test_extend_attention(impl: str, dtype: torch.dtype, heads: int, kv_heads: int,
                          head_dim: int, case: str) -> None:
    g = gen(8)
    page_size, prefix_lens, ext_lens = EXTEND_CASES[case]
    seq_lens = [p + n for p, n in zip(prefix_lens, ext_lens)]
    pool = make_pool(seq_lens, kv_heads, head_dim, page_size, dtype, g)
    q = randn(sum(ext_lens), heads, head_dim, dtype=dtype, g=g)
    starts = [sum(ext_lens[:b]) for b in range(len(ext_lens))]
    t = lambda xs: torch.tensor(xs, device=DEVICE)  # noqa: E731
    args = (pool.req_to_token, pool.rows, t(seq_lens), t(prefix_lens), t(ext_lens), t(starts),
            head_dim**-0.5, max(ext_lens))
    expected = attention_extend.extend_attention_reference(q.float(), pool.k.float(),
                                                           pool.v.float(), *args)
    out = op(attention_extend, "extend_attention", impl)(q, pool.k, pool.v, *args)
    assert out.shape == q.shape and out.dtype == dtype
    close(out, expected, dtype)
    if dtype == torch.float32 and impl == "reference":
        dense = sdpa_attention(q, pool, seq_lens, prefix_lens, ext_lens)
        torch.testing.assert_close(expected, dense, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", GQA[1:])
@pytest.mark.parametrize("case", ["prefix", "mixed_decode_rows"])
def test_extend_attention_float8_pool(impl: str, dtype: torch.dtype, heads: int, kv_heads: int,
                                      head_dim: int, case: str) -> None:
    g = gen(19)
    page_size, prefix_lens, ext_lens = EXTEND_CASES[case]
    seq_lens = [p + n for p, n in zip(prefix_lens, ext_lens)]
    pool = float8_pool(make_pool(seq_lens, kv_heads, head_dim, page_size, torch.float32, g))
    q = randn(sum(ext_lens), heads, head_dim, dtype=dtype, g=g)
    starts = [sum(ext_lens[:b]) for b in range(len(ext_lens))]
    t = lambda xs: torch.tensor(xs, device=DEVICE)  # noqa: E731
    args = (pool.req_to_token, pool.rows, t(seq_lens), t(prefix_lens), t(ext_lens), t(starts),
            head_dim**-0.5, max(ext_lens))
    expected = attention_extend.extend_attention_reference(q.float(), pool.k_wide, pool.v_wide,
                                                           *args)
    out = op(attention_extend, "extend_attention", impl)(q, pool.k, pool.v, *args)
    assert out.shape == q.shape and out.dtype == dtype
    close(out, expected, dtype)


# --------------------------------------------------------------------------- backend, dispatch


def make_forward_batch(mode: ForwardMode, prefix_lens: list[int], ext_lens: list[int],
                       dtype: torch.dtype, page_size: int, g: torch.Generator,
                       kv_heads: int = 2, head_dim: int = 32) -> ForwardBatch:
    seq_lens = [p + n for p, n in zip(prefix_lens, ext_lens)]
    pool = make_pool(seq_lens, kv_heads, head_dim, page_size, dtype, g)
    other = make_pool(seq_lens, kv_heads, head_dim, page_size, dtype, g)  # layer 0: unused
    locs = [pool.req_to_token[pool.rows[b], p : p + n] for b, (p, n)
            in enumerate(zip(prefix_lens, ext_lens))]
    t = lambda xs: torch.tensor(xs, dtype=torch.long, device=DEVICE)  # noqa: E731
    total = sum(ext_lens)
    return ForwardBatch(
        mode=mode, batch_size=len(seq_lens),
        input_ids=torch.zeros(total, dtype=torch.long, device=DEVICE),
        positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, ext_lens)]).to(DEVICE),
        out_cache_loc=torch.cat(locs).long(),
        req_pool_indices=pool.rows, seq_lens=t(seq_lens), extend_prefix_lens=t(prefix_lens),
        extend_seq_lens=t(ext_lens),
        extend_start=t([sum(ext_lens[:b]) for b in range(len(ext_lens))]),
        seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=prefix_lens, extend_seq_lens_cpu=ext_lens,
        logits_indices=t([sum(ext_lens[: b + 1]) - 1 for b in range(len(ext_lens))]),
        req_to_token=pool.req_to_token,
        kv_pool=SimpleNamespace(k_buffer=[other.k, pool.k], v_buffer=[other.v, pool.v]),
        attn_backend=None,  # type: ignore[arg-type]
    )


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
@pytest.mark.parametrize("float8", [False, True], ids=["model_dtype_pool", "float8_pool"])
def test_triton_backend(dtype: torch.dtype, mode: ForwardMode, float8: bool) -> None:
    if float8:
        skip_float8_store_off_cuda("triton")
    g = gen(9)
    if mode is ForwardMode.DECODE:
        prefix_lens, ext_lens = [0, 40, 99, 16], [1, 1, 1, 1]
    else:
        prefix_lens, ext_lens = [0, 40, 99, 16], [30, 1, 1, 20]  # prefill + decode rows
    fb = make_forward_batch(mode, prefix_lens, ext_lens, dtype, 16, g)
    if float8:  # kv_cache_dtype="fp8_e4m3": the store rounds into it, attention widens it
        for buffers in (fb.kv_pool.k_buffer, fb.kv_pool.v_buffer):
            buffers[:] = [kv_store.to_pool_dtype(b, FP8) for b in buffers]
    backend = TritonAttentionBackend(dispatch.resolve_kernels("triton", DEVICE, dtype), num_sms=4)
    fb.attn_backend = backend
    heads, (kv_heads, head_dim) = 6, fb.kv_pool.k_buffer[1].shape[1:]
    q = randn(fb.num_tokens, heads, head_dim, dtype=dtype, g=g)
    k = randn(fb.num_tokens, kv_heads, head_dim, dtype=dtype, g=g)
    v = randn(fb.num_tokens, kv_heads, head_dim, dtype=dtype, g=g)
    k_expected, v_expected = fb.kv_pool.k_buffer[1].clone(), fb.kv_pool.v_buffer[1].clone()
    layer0 = fb.kv_pool.k_buffer[0].clone()
    kv_store.kv_store_reference(k_expected, v_expected, k, v, fb.out_cache_loc)
    expected = attention_extend.extend_attention_reference(
        q.float(), k_expected.float(), v_expected.float(), fb.req_to_token, fb.req_pool_indices,
        fb.seq_lens, fb.extend_prefix_lens, fb.extend_seq_lens, fb.extend_start,
        head_dim**-0.5)

    backend.prepare(fb)
    out = backend.forward(q, k, v, 1, head_dim**-0.5, fb)
    assert_same_bits(fb.kv_pool.k_buffer[1], k_expected)
    assert_same_bits(fb.kv_pool.v_buffer[1], v_expected)
    assert_same_bits(fb.kv_pool.k_buffer[0], layer0)  # other layers untouched
    close(out, expected, dtype)


def test_triton_backend_decode_metadata_is_shape_only() -> None:
    """DECODE launch parameters must not depend on lengths (CUDA-graph replay)."""
    backend = TritonAttentionBackend(dispatch.resolve_kernels("reference", DEVICE, torch.float32),
                                     num_sms=132)
    metas = []
    for seq_lens in ([5, 7], [3000, 1]):
        fb = make_forward_batch(ForwardMode.DECODE, [n - 1 for n in seq_lens], [1, 1],
                                torch.float32, 1, gen(10))
        backend.prepare(fb)
        metas.append(fb.attn_metadata)
    assert metas[0] == metas[1] and metas[0].num_kv_splits > 1


def test_kernel_set_triton_mode_off_cuda_needs_the_interpreter() -> None:
    if not triton_compat.HAS_TRITON:
        with pytest.raises(InvalidConfigError, match="needs the `triton` package"):
            dispatch.resolve_kernels("triton", DEVICE, torch.float32)
    elif DEVICE.type == "cpu" and not triton_compat.is_interpreted(triton_rmsnorm._rmsnorm_kernel):
        with pytest.raises(InvalidConfigError, match="TRITON_INTERPRET=1"):
            dispatch.resolve_kernels("triton", DEVICE, torch.float32)
    else:
        ks = dispatch.resolve_kernels("triton", DEVICE, torch.float32)
        assert ks.rmsnorm is triton_rmsnorm.rmsnorm_triton and ks.attention == "triton"


def _agree_case(op: str, ks: dispatch.KernelSet) -> list[torch.Tensor]:
    """Run `op` of `ks` on fixed inputs (a copy of everything it writes); return its outputs."""
    g = gen(11)
    x, r = randn(3, 64, dtype=torch.float32, g=g), randn(3, 64, dtype=torch.float32, g=g)
    w = randn(64, dtype=torch.float32, g=g)
    if op == "rmsnorm":
        return [ks.rmsnorm(x, w, 1e-6)]
    if op == "fused_add_rmsnorm":
        return list(ks.fused_add_rmsnorm(x, r, w, 1e-6))
    if op == "silu_and_mul":
        return [ks.silu_and_mul(x)]
    if op == "linear":
        x1, w16 = x[:1].bfloat16(), randn(40, 64, dtype=torch.bfloat16, g=g)  # one row: GEMV
        return [ks.linear(x1, w16, None).float(), ks.linear(x, w, None)]
    if op == "argmax":
        return [ks.argmax(x).float()]
    if op == "apply_token_bitmask":
        logits = x.clone()
        bitmask = torch.tensor([[5, -1], [0, 3], [-7, 9]], dtype=torch.int32, device=DEVICE)
        ks.apply_token_bitmask(logits, bitmask, None)
        return [logits]
    fb = make_forward_batch(ForwardMode.EXTEND, [9, 20], [3, 1], torch.float32, 1, g)
    q = randn(4, 4, 32, dtype=torch.float32, g=g)
    kb, vb = fb.kv_pool.k_buffer[1].clone(), fb.kv_pool.v_buffer[1].clone()
    table = (fb.req_to_token, fb.req_pool_indices, fb.seq_lens)
    if op == "rotary_embedding":
        cache = rotary.make_cos_sin_cache(64, 32, device=DEVICE)
        k = randn(4, 2, 32, dtype=torch.float32, g=g)
        return list(ks.rotary_embedding(fb.positions, q.clone(), k, cache, True))
    if op == "kv_store":
        ks.kv_store(kb, vb, q[:, :2], q[:, 2:], fb.out_cache_loc)
        return [kb, vb]
    if op == "rotary_kv_store":
        cache = rotary.make_cos_sin_cache(64, 32, device=DEVICE)
        q = q.clone()  # (q, k and v disjoint, as the slices of one qkv projection are)
        k, v = randn(4, 2, 32, dtype=torch.float32, g=g), randn(4, 2, 32, dtype=torch.float32, g=g)
        ks.rotary_kv_store(fb.positions, q, k, v, cache, kb, vb, fb.out_cache_loc)
        return [q, kb, vb]
    if op == "decode_attention":
        return [ks.decode_attention(q[:2], kb, vb, *table, 0.2, 2)]
    assert op == "extend_attention", f"no agreement case for op {op!r}"
    return [ks.extend_attention(q, kb, vb, *table, fb.extend_prefix_lens, fb.extend_seq_lens,
                                fb.extend_start, 0.2, 3)]


@needs_triton
@pytest.mark.parametrize("op", dispatch.KernelSet.ops())
def test_kernel_set_triton_ops_agree_with_reference_ops(op: str) -> None:
    """Every op of the Triton set against the same op of the reference set, as the layers and
    the attention backend call them."""
    triton_set = dispatch.resolve_kernels("triton", DEVICE, torch.float32)
    reference_set = dispatch.resolve_kernels("reference", DEVICE, torch.float32)
    assert getattr(triton_set, op) is not getattr(reference_set, op)
    for got, want in zip(_agree_case(op, triton_set), _agree_case(op, reference_set), strict=True):
        close(got, want, torch.bfloat16 if op == "linear" else torch.float32)


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_triton_backend_rotates_and_stores_in_one_op(kernels: str) -> None:
    """Given the layer's rotary, the backend's output and pool equal rotating first and
    calling it without (what the torch backend does), in extend and decode steps."""
    if kernels == "triton" and not TRITON_HERE:
        pytest.skip(NO_TRITON)
    from sgl.backend.layers.rotary import RotaryEmbedding

    ks = dispatch.resolve_kernels(kernels, DEVICE, torch.float32)
    rope = RotaryEmbedding(32, 64, {"rope_theta": 10000.0, "rope_type": "default"}, kernels=ks,
                           device=torch.device(DEVICE), dtype=torch.float32)
    backend = TritonAttentionBackend(ks, num_sms=4)
    for mode, ext_lens in ((ForwardMode.EXTEND, [5, 1]), (ForwardMode.DECODE, [1, 1])):
        outs, pools = [], []
        for fused in (True, False):
            fb = make_forward_batch(mode, [3, 7], ext_lens, torch.float32, 1, gen(12))
            backend.prepare(fb)
            q = randn(fb.num_tokens, 4, 32, dtype=torch.float32, g=gen(13))
            k = randn(fb.num_tokens, 2, 32, dtype=torch.float32, g=gen(14))
            v = randn(fb.num_tokens, 2, 32, dtype=torch.float32, g=gen(15))
            if fused:
                outs.append(backend.forward(q, k, v, 1, 0.2, fb, rotary=rope))
            else:
                q, k = rope(fb.positions, q, k)
                outs.append(backend.forward(q, k, v, 1, 0.2, fb))
            pools.append(fb.kv_pool.k_buffer[1])
        close(outs[0], outs[1], torch.float32)
        close(pools[0], pools[1], torch.float32)


def test_triton_backend_runs_its_kernel_sets_attention_ops() -> None:
    calls: list[str] = []
    ref = dispatch.resolve_kernels("reference", DEVICE, torch.float32)

    def spy(name: str) -> Callable[..., Any]:
        fn = getattr(ref, name)
        return lambda *args, **kwargs: calls.append(name) or fn(*args, **kwargs)

    spied = dataclasses.replace(ref, **{n: spy(n) for n in
                                        ("kv_store", "decode_attention", "extend_attention")})
    backend = TritonAttentionBackend(spied, num_sms=4)
    for mode, ext_lens in ((ForwardMode.EXTEND, [5, 1]), (ForwardMode.DECODE, [1, 1])):
        fb = make_forward_batch(mode, [3, 7], ext_lens, torch.float32, 1, gen(12))
        backend.prepare(fb)
        q = randn(fb.num_tokens, 4, 32, dtype=torch.float32, g=gen(13))
        kv = randn(fb.num_tokens, 2, 32, dtype=torch.float32, g=gen(14))
        backend.forward(q, kv, kv, 1, 0.2, fb)
    assert calls == ["kv_store", "extend_attention", "kv_store", "decode_attention"]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,context", [(1, 4096), (64, 1024)])
def test_gpu_attention_realistic(batch: int, context: int) -> None:
    """Llama-3-8B attention shapes in bf16 on a real GPU (decode and prefill)."""
    g = gen(12)
    heads, kv_heads, head_dim = 32, 8, 128
    pool = make_pool([context] * batch, kv_heads, head_dim, 16, torch.bfloat16, g)
    lens = torch.full((batch,), context, device=DEVICE)
    q = randn(batch, heads, head_dim, dtype=torch.bfloat16, g=g)
    splits = triton_attention_decode.decode_num_kv_splits(batch, kv_heads)
    args = (pool.req_to_token, pool.rows, lens, head_dim**-0.5)
    expected = attention_decode.decode_attention_reference(q, pool.k, pool.v, *args)
    kernels = dispatch.resolve_kernels("triton", DEVICE, torch.bfloat16)
    close(kernels.decode_attention(q, pool.k, pool.v, *args, splits), expected, torch.bfloat16)
    ext = min(context, 512)
    t = lambda xs: torch.tensor(xs, device=DEVICE)  # noqa: E731
    qe = randn(ext * batch, heads, head_dim, dtype=torch.bfloat16, g=g)
    ext_args = (pool.req_to_token, pool.rows, lens, t([context - ext] * batch), t([ext] * batch),
                t([b * ext for b in range(batch)]), head_dim**-0.5, ext)
    close(kernels.extend_attention(qe, pool.k, pool.v, *ext_args),
          attention_extend.extend_attention_reference(qe, pool.k, pool.v, *ext_args),
          torch.bfloat16)


@skip_unless_rerun_needed(TRITON_HERE)
def test_triton_kernels_in_subprocess() -> None:
    """Triton was imported before this module could ask for its interpreter: rerun here."""
    rerun_interpreted(__file__, "-k", "triton or backend or kernel_set")
