"""The fused CPU ops (backend/quant/cpu_ops.c) against the torch references they replace in
the CPU "auto" kernel set: RMSNorm (plain and with the residual add), SiLU*mul, rotary in
place on views of a fused qkv, the KV store; on odd sizes that exercise the C loops' tails,
and inputs they do not cover falling back to the reference. Decode attention is tested through
the attention backend (tests/test_attention_torch.py, `fused`)."""

from __future__ import annotations

import pytest
import torch

from sgl.backend.kernels.activation import silu_and_mul_reference
from sgl.backend.kernels.kv_store import kv_store_reference
from sgl.backend.kernels.rmsnorm import fused_add_rmsnorm_reference, rmsnorm_reference
from sgl.backend.kernels.rotary import make_cos_sin_cache, rope_inv_freq, \
    rotary_embedding_reference
from sgl.backend.quant import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(),
                                reason="no C compiler or no AVX2/FMA: the references serve")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("tokens,hidden", [(1, 576), (3, 37), (5, 8)])
def test_rmsnorm_matches_the_reference(tokens: int, hidden: int) -> None:
    gen = _gen(hidden)
    x = torch.randn(tokens, hidden, generator=gen) * 3
    r = torch.randn(tokens, hidden, generator=gen)
    w = torch.randn(hidden, generator=gen)
    torch.testing.assert_close(cpu_ops.rmsnorm(x, w, 1e-5), rmsnorm_reference(x, w, 1e-5),
                               rtol=2e-6, atol=2e-6)
    normed, summed = cpu_ops.fused_add_rmsnorm(x, r, w, 1e-5)
    ref_normed, ref_summed = fused_add_rmsnorm_reference(x, r, w, 1e-5)
    assert torch.equal(summed, ref_summed)  # the residual stream is bit-exact
    torch.testing.assert_close(normed, ref_normed, rtol=2e-6, atol=2e-6)
    assert not torch.equal(x, summed)  # (the inputs are left alone)


@pytest.mark.parametrize("tokens,inter", [(1, 1536), (4, 13)])
def test_silu_and_mul_matches_the_reference(tokens: int, inter: int) -> None:
    gen = _gen(inter)
    x = torch.randn(tokens, 2 * inter, generator=gen) * 4
    x[0, :4] = torch.tensor([-120.0, -88.0, 90.0, 0.0])  # past exp's clamp on both sides
    got = cpu_ops.silu_and_mul(x)
    torch.testing.assert_close(got, silu_and_mul_reference(x), rtol=2e-6, atol=1e-6)


def _cache(max_pos: int, rotary_dim: int) -> torch.Tensor:
    return make_cos_sin_cache(max_pos, rotary_dim, inv_freq=rope_inv_freq(rotary_dim, 10000.0),
                              device=torch.device("cpu"), dtype=torch.float32)


@pytest.mark.parametrize("fused_qkv", [True, False])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (20, 12)])
def test_rotary_in_place_matches_the_reference(fused_qkv: bool, head_dim: int,
                                               rotary_dim: int) -> None:
    tokens, heads, kv_heads = 5, 6, 2
    gen = _gen(head_dim)
    cache = _cache(300, rotary_dim)
    positions = torch.tensor([0, 7, 299, 3, 150])
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    if fused_qkv:  # views of one projection output: the one-pass layout
        q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    else:
        q = torch.randn(tokens, heads, head_dim, generator=gen)
        k = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    ref_q, ref_k = rotary_embedding_reference(positions, q.clone(), k.clone(), cache, False)
    got_q, got_k = cpu_ops.rotary_embedding(positions, q, k, cache, True)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    torch.testing.assert_close(q, ref_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, ref_k, rtol=1e-6, atol=1e-6)
    if fused_qkv:  # v, after k in the same rows, is untouched
        v = qkv[:, (heads + kv_heads) * head_dim:]
        assert torch.equal(v, torch.randn(tokens, (heads + 2 * kv_heads) * head_dim,
                                          generator=_gen(head_dim))[:, (heads + kv_heads)
                                                                     * head_dim:])


def test_kv_store_writes_strided_rows_to_their_slots() -> None:
    tokens, kv_heads, head_dim = 4, 3, 20
    gen = _gen(0)
    qkv = torch.randn(tokens, 5 * kv_heads * head_dim, generator=gen)
    k = qkv[:, 3 * kv_heads * head_dim:4 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, 4 * kv_heads * head_dim:].view(tokens, kv_heads, head_dim)
    loc = torch.tensor([9, 2, 31, 5])
    got_k, got_v = torch.zeros(40, kv_heads, head_dim), torch.zeros(40, kv_heads, head_dim)
    ref_k, ref_v = torch.zeros_like(got_k), torch.zeros_like(got_v)
    cpu_ops.kv_store(got_k, got_v, k, v, loc)
    kv_store_reference(ref_k, ref_v, k, v, loc)
    assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)


def test_uncovered_inputs_fall_back_to_the_reference() -> None:
    gen = _gen(1)
    x = torch.randn(3, 40, generator=gen).bfloat16()
    w = torch.randn(40, generator=gen).bfloat16()
    assert torch.equal(cpu_ops.rmsnorm(x, w), rmsnorm_reference(x, w))
    strided = torch.randn(40, 3, generator=gen).t()  # [3, 40], not contiguous
    assert torch.equal(cpu_ops.silu_and_mul(strided), silu_and_mul_reference(strided))
    cache = _cache(16, 8)
    q, k = torch.randn(2, 2, 8, generator=gen), torch.randn(2, 1, 8, generator=gen)
    pos = torch.tensor([1, 2])
    out_q, out_k = cpu_ops.rotary_embedding(pos, q, k, cache, False)  # out of place
    ref_q, ref_k = rotary_embedding_reference(pos, q, k, cache, False)
    assert out_q.data_ptr() != q.data_ptr()
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)


KV_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]
_BITS = {4: torch.int32, 2: torch.int16, 1: torch.int8}  # element size -> its bits' dtype


def _rounding_cases() -> torch.Tensor:
    """float32 values where rounding is delicate: exact halfway points between two float16 /
    bfloat16 / e4m3 neighbours (ties to even, both ways), float16 subnormals and overflow,
    bfloat16's carry into the exponent, e4m3's subnormals (ties among multiples of 2^-9, the
    step up to its smallest normal 2^-6) and its saturation at 448 (ties at 456 and 464,
    beyond), signed zero, infinities."""
    tie_f16 = [1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, -(2.0 + 2.0 ** -10)]
    tie_bf16 = [1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -(3.0 + 2.0 ** -7)]
    e4m3 = [1.0 + 2.0 ** -4, 1.0 + 3 * 2.0 ** -4, -(6.0 + 2.0 ** -1), 2.0 ** -10, 3 * 2.0 ** -10,
            -5 * 2.0 ** -10, 2.0 ** -6 - 2.0 ** -10, 2.0 ** -6 - 2.0 ** -11, 2.0 ** -11, 447.0,
            456.0, 464.0, -480.0, 1000.0, 0.0137, -0.3]
    odd = [2.0 ** -20, -3e-6, 6.1e-5, 65504.0, 65520.0, 70000.0, -1e9, 1.9921875 + 2 ** -9,
           0.0, -0.0, float("inf"), float("-inf"), 1e-40, 3.4e38]
    return torch.tensor(tie_f16 + tie_bf16 + e4m3 + odd, dtype=torch.float32)


def test_e4m3_pool_rounding_known_values() -> None:
    """What the reference store into a float8 e4m3 pool writes (the C store is held to its
    bits below): nearest even, subnormals in steps of 2^-9, saturation at +-448 instead of
    NaN (older torch versions convert an overflow to NaN), NaN kept."""
    from sgl.backend.kernels.kv_store import to_pool_dtype

    x = torch.tensor([1.0 + 2.0 ** -4, 1.0 + 3 * 2.0 ** -4, 2.0 ** -10, 3 * 2.0 ** -10, 456.0,
                      1e9, float("-inf"), float("nan")])
    got = to_pool_dtype(x, torch.float8_e4m3fn).float()
    expected = [1.0, 1.25, 0.0, 2.0 ** -8, 448.0, 448.0, -448.0]
    assert got[:-1].tolist() == expected and got[-1].isnan()


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_kv_store_rounds_exactly_as_torch(dtype: torch.dtype,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The C store into a narrower pool (F16C for float16, round-to-nearest-even for bfloat16
    and e4m3) writes the bits of the reference's rounding, on random rows and delicate values."""
    assert cpu_ops.kv_dtype_supported(dtype)
    tokens, kv_heads, head_dim = 6, 3, 20  # rows of 60: the 8-wide loop and its tail
    gen = _gen(7)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen) * 10
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen) / 10
    cases = _rounding_cases()
    k.view(-1)[:cases.numel()] = cases
    v.view(-1)[-cases.numel():] = cases.flip(0)
    loc = torch.tensor([9, 2, 31, 5, 17, 1])
    got_k = torch.zeros(40, kv_heads, head_dim, dtype=dtype)
    got_v = torch.zeros_like(got_k)
    ref_k, ref_v = torch.zeros_like(got_k), torch.zeros_like(got_v)
    with monkeypatch.context() as patch:  # the C store itself, not a fallback
        patch.setattr(cpu_ops, "kv_store_reference", None)
        cpu_ops.kv_store(got_k, got_v, k, v, loc)
    kv_store_reference(ref_k, ref_v, k, v, loc)
    bits = _BITS[dtype.itemsize]  # compare bits: -0.0, inf
    assert torch.equal(got_k.view(bits), ref_k.view(bits))
    assert torch.equal(got_v.view(bits), ref_v.view(bits))


def _attention_case(head_dim: int, heads: int, dtype: torch.dtype, lens: list[int]):
    """A pool of 2 KV heads with the requests' keys at scattered slots, and query rows:
    (q, k_buf, v_buf, table, lens, rows), request b's query in row rows[b] of q (row 3 is
    nobody's)."""
    gen = _gen(head_dim)
    kv_heads = 2
    slots = sum(lens) + 8
    k_buf = torch.randn(slots, kv_heads, head_dim, generator=gen).to(dtype)
    v_buf = torch.randn(slots, kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(slots - 1, generator=gen) + 1
    table = torch.zeros(len(lens), max(lens), dtype=torch.int32)
    start = 0
    for b, n in enumerate(lens):
        table[b, :n] = order[start:start + n].int()
        start += n
    q = torch.randn(len(lens) + 1, heads, head_dim, generator=gen) * 2
    rows = torch.tensor([1, 0, 4, 2, 5, 6][:len(lens)])
    return q, k_buf, v_buf, table, torch.tensor(lens), rows


def _decode_attention(q, k_buf, v_buf, table, lens, rows) -> torch.Tensor:
    out = torch.full_like(q, 7.0)
    cpu_ops.decode_attention(q, k_buf, v_buf, table, torch.arange(len(lens)), lens,
                             q.shape[-1] ** -0.5, rows, out)
    return out


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 72, 128, 16, 20])
@pytest.mark.parametrize("heads", [6, 2, 8, 14])  # over 2 KV heads: groups of 3, 1, 4, 7
def test_decode_attention_matches_a_float64_reference(head_dim: int, dtype: torch.dtype,
                                                      heads: int) -> None:
    """Head sizes of every path of the kernel: 64, 72 and 128 (several 8-wide chunks per
    pass over the values, a partial last pass), 16 (one chunk), 20 (not a multiple of 8: the
    plain loop); lengths that are and are not multiples of the 2-key and 16-key blocks; 1 to 7
    query heads per KV head (read together in groups of up to four: 7 = 4 + 3), keys at
    scattered slots, one request's query row chosen by q_rows. A narrower pool is read widened
    to float32 (exact), so the float32 tolerance holds for every dtype."""
    case = _attention_case(head_dim, heads, dtype, [1, 3, 4, 37, 16])
    q, k_buf, v_buf, table, lens, rows = case
    out = _decode_attention(*case)
    kv_heads = k_buf.shape[1]
    for b, n in enumerate(lens.tolist()):
        keys = table[b, :n].long()
        for h in range(heads):
            kvh = h // (heads // kv_heads)
            scores = k_buf[keys, kvh].double() @ q[rows[b], h].double() * head_dim ** -0.5
            expected = torch.softmax(scores, 0) @ v_buf[keys, kvh].double()  # [head_dim]
            torch.testing.assert_close(out[rows[b], h].double(), expected, rtol=1e-5,
                                       atol=1e-5)
    assert torch.equal(out[3], torch.full_like(out[3], 7.0))  # other rows left alone


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 16, 72])  # 72: no 16-lane chunks, AVX2 only
@pytest.mark.parametrize("heads", [6, 2, 8, 14])
def test_decode_attention_avx512_gives_the_bits_of_avx2(head_dim: int, dtype: torch.dtype,
                                                        heads: int) -> None:
    """The AVX-512 twin (16 keys' scores summed together, 16-lane value chunks) reproduces
    the AVX2 loops bit for bit: lengths below, at and past the 16-key blocks, with tails."""
    from sgl.backend.quant import cpu_kernel

    if not cpu_kernel.use_avx512(True):
        pytest.skip("no AVX-512 on this CPU: the AVX2 loops serve")
    case = _attention_case(head_dim, heads, dtype, [1, 15, 16, 25, 70, 450])
    try:
        wide = _decode_attention(*case)
        assert not cpu_kernel.use_avx512(False)
        narrow = _decode_attention(*case)
    finally:
        cpu_kernel.use_avx512(True)
    assert torch.equal(wide.view(torch.int32), narrow.view(torch.int32))
