"""Sampler: filters, penalties, seeds, grammar masks and logprobs, on small CPU tensors."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, Sequence

import pytest
import torch

from sgl.backend.penalties import PenaltyPool
from sgl.backend.sampler import (
    Sampler,
    SamplingBatchInfo,
    filtered_probs,
    gather_logprobs,
    process_logits,
    sample,
    seeded_uniform,
)
from sgl.sampling import LogprobOptions, SamplingParams

SP = SamplingParams


def info_for(params: Sequence[SamplingParams], vocab: int, output_lens: Sequence[int] | None = None, **kw: Any) -> SamplingBatchInfo:
    lens = list(output_lens) if output_lens is not None else [0] * len(params)
    return SamplingBatchInfo.build(params, vocab_size=vocab, device="cpu", output_lens=lens, **kw)


def logits_of(probs: Sequence[float]) -> torch.Tensor:
    return torch.tensor([probs], dtype=torch.float32).log()  # [1, V]


def reference_filter(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Tokens a plain loop keeps: top-k, then the nucleus of the renormalised rest, then min-p."""
    order = sorted(range(len(probs)), key=lambda t: -float(probs[t]))
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(float(probs[t]) for t in kept)
    nucleus, acc = [], 0.0
    for t in kept:
        if acc >= top_p * mass:
            break
        nucleus.append(t)
        acc += float(probs[t])
    top = float(probs[order[0]])
    return {t for t in nucleus if float(probs[t]) >= min_p * top}


# -- greedy ------------------------------------------------------------------------------------


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    logits[2, 7] = logits[2, 250] = 50.0  # a tie: torch.argmax picks the lower id
    info = info_for([SP(temperature=0.0)] * 5 + [SP(top_k=1)], 300)
    assert info.all_greedy
    out = sample(logits.clone(), info)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert out.next_token_ids[2] == 7


def test_greedy_rows_in_a_sampling_batch_are_argmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 500)
    info = info_for([SP(temperature=0.0), SP(temperature=1.5, top_p=0.5), SP(top_k=1), SP(min_p=0.3)], 500)
    out = sample(logits.clone(), info, generator=torch.Generator().manual_seed(0))
    assert out.next_token_ids[0] == logits[0].argmax() and out.next_token_ids[2] == logits[2].argmax()


# -- filters -----------------------------------------------------------------------------------


def kept(params: SamplingParams, probs: Sequence[float]) -> set[int]:
    p = filtered_probs(logits_of(probs), info_for([params], len(probs)))[0]
    return {i for i, v in enumerate(p.tolist()) if v > 0}


def test_top_k_keeps_the_k_most_likely() -> None:
    probs = [0.05, 0.4, 0.1, 0.3, 0.15]
    assert kept(SP(top_k=2), probs) == {1, 3}
    assert kept(SP(top_k=1, temperature=0.5), probs) == set(range(5))  # top_k=1 is greedy: no filter
    p = filtered_probs(logits_of(probs), info_for([SP(top_k=3)], 5))[0]
    assert torch.allclose(p / p.sum(), torch.tensor([0, 0.4, 0, 0.3, 0.15]) / 0.85, atol=1e-6)


def test_top_p_keeps_exactly_the_nucleus() -> None:
    probs = [0.1, 0.4, 0.2, 0.3]
    assert kept(SP(top_p=0.35), probs) == {1}
    assert kept(SP(top_p=0.65), probs) == {1, 3}  # 0.4 < 0.65 so token 3 joins; 0.7 >= 0.65 stops
    assert kept(SP(top_p=0.75), probs) == {1, 3, 2}
    assert kept(SP(top_p=1.0), probs) == {0, 1, 2, 3}
    # Exact boundary (powers of two are exact): 0.5 already reaches top_p=0.5, so one token.
    assert kept(SP(top_p=0.5), [0.5, 0.25, 0.25]) == {0}
    assert kept(SP(top_p=0.75), [0.5, 0.25, 0.125, 0.125]) == {0, 1}
    # top-p acts on what top-k leaves, renormalised: 0.4 / 0.7 = 0.57 < 0.6, so both stay
    assert kept(SP(top_k=2, top_p=0.6), probs) == {1, 3}
    assert kept(SP(top_k=2, top_p=0.5), probs) == {1}


def test_min_p_is_relative_to_the_top_token() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    assert kept(SP(min_p=0.2), probs) == {0, 1, 2}  # threshold 0.1
    assert kept(SP(min_p=0.7), probs) == {0}


def test_temperature_scales_logits() -> None:
    logits = torch.randn(1, 50)
    p = filtered_probs(logits.clone(), info_for([SP(temperature=0.5)], 50))
    assert torch.allclose(p, torch.softmax(logits / 0.5, -1), atol=1e-6)


@pytest.mark.parametrize("vocab", [300, 5000])
def test_filters_match_a_plain_loop_on_mixed_batches(vocab: int) -> None:
    # vocab 5000 with a flat distribution makes the CPU nucleus wider than the 1024 candidates
    # it reads first, so those rows take the full-sort path.
    gen = torch.Generator().manual_seed(3)
    params = [SP(top_p=0.9), SP(top_k=20, top_p=0.8), SP(top_k=7), SP(min_p=0.05, top_p=0.95),
              SP(temperature=0.0, top_p=0.3), SP(top_p=0.97, temperature=3.0), SP(top_k=40, min_p=0.2)]  # fmt: skip
    logits = torch.randn(len(params), vocab, generator=gen) * 2.0
    probs = filtered_probs(logits.clone(), info_for(params, vocab))
    for b, p in enumerate(params):
        if p.is_greedy:
            continue
        raw = torch.softmax(logits[b] / p.temperature, -1)
        assert {int(t) for t in probs[b].nonzero()} == reference_filter(raw, p.top_k, p.top_p, p.min_p), b


def test_sampling_follows_the_filtered_distribution() -> None:
    # 20k seeded draws (one per step): frequencies match the renormalised nucleus.
    probs = torch.tensor([0.35, 0.05, 0.25, 0.2, 0.15])
    n = 20000
    params = [SP(top_p=0.7, seed=11)] * n
    info = info_for(params, 5, seed_steps=list(range(n)))
    ids = sample(probs.log().expand(n, 5).clone(), info).next_token_ids
    freq = torch.bincount(ids, minlength=5).double() / n
    expected = torch.tensor([0.35, 0, 0.25, 0.2, 0]) / 0.8  # nucleus {0, 2, 3}
    assert freq[1] == 0 and freq[4] == 0
    assert torch.allclose(freq, expected.double(), atol=0.015), freq


def test_seeded_uniform_is_uniform() -> None:
    u = seeded_uniform(torch.full((50000,), 123), torch.arange(50000))
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    hist = torch.histc(u, bins=10, min=0.0, max=1.0) / 50000
    assert torch.allclose(hist, torch.full((10,), 0.1), atol=0.01)


# -- seeds ---------------------------------------------------------------------------------------


def run_steps(params: list[SamplingParams], logits: torch.Tensor, steps: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        info = info_for(params, logits.shape[1], output_lens=[step] * len(params))
        out.append(sample(logits.clone(), info, generator=gen).next_token_ids)
    return torch.stack(out, 1)  # [B, steps]


def test_seeded_requests_draw_the_same_tokens_alone_and_batched() -> None:
    gen = torch.Generator().manual_seed(5)
    vocab = 3000
    seeded = [SP(seed=1), SP(seed=2, top_p=0.9, temperature=0.8), SP(seed=3, top_k=50), SP(seed=2**40 + 7, min_p=0.01)]
    others = [SP(temperature=0.0), SP(top_p=0.5), SP(top_k=5, top_p=0.3), SP(temperature=2.0), SP(top_k=2000, top_p=0.99)]
    rows = torch.randn(len(seeded), vocab, generator=gen) * 2
    noise = torch.randn(len(others), vocab, generator=gen) * 2
    alone = torch.cat([run_steps([p], rows[i : i + 1], 12, seed=0) for i, p in enumerate(seeded)])
    for trial in range(3):
        perm = torch.randperm(len(seeded) + len(others), generator=gen).tolist()
        batch = (seeded + others)
        params = [batch[i] for i in perm]
        logits = torch.cat([rows, noise])[perm]
        got = run_steps(params, logits, 12, seed=trial)
        for pos, i in enumerate(perm):
            if i < len(seeded):
                assert torch.equal(got[pos], alone[i]), (trial, i)
    assert len({tuple(r) for r in alone.tolist()}) == len(seeded)  # different seeds differ


def test_seeded_samples_of_one_prompt_differ_and_the_generator_is_reproducible() -> None:
    logits = torch.zeros(2, 1000)  # uniform: draws are all noise
    params = [SP(seed=9), SP(seed=9)]
    info = info_for(params, 1000, sample_indices=[0, 1], seed_steps=[0, 0])
    a, b = sample(logits.clone(), info).next_token_ids.tolist()
    assert a != b
    single = info_for([SP(seed=9)], 1000)
    assert sample(logits[:1].clone(), single).next_token_ids.item() == a  # sample 0 = plain seed
    unseeded = info_for([SP()] * 2, 1000)
    x = Sampler(vocab_size=1000, max_rows=4, device="cpu", seed=42).sample(logits.clone(), unseeded)
    y = Sampler(vocab_size=1000, max_rows=4, device="cpu", seed=42).sample(logits.clone(), unseeded)
    assert torch.equal(x.next_token_ids, y.next_token_ids)


# -- penalties in a batch, min_new_tokens, masks -------------------------------------------------


def test_penalty_pool_counts_generated_tokens_and_penalises_them() -> None:
    vocab = 10
    pool = PenaltyPool(num_rows=4, vocab_size=vocab, device="cpu")
    rep, freq = SP(temperature=0.0, repetition_penalty=2.0), SP(temperature=0.0, frequency_penalty=1.0)
    plain = SP(temperature=0.0)
    pool.start(1, rep, prompt_ids=[4], output_ids=[])
    pool.start(3, freq, output_ids=[5, 5])
    pool.add(torch.tensor([1, 3]), torch.tensor([6, 5]))
    assert pool.counts is not None and pool.counts[3, 5] == 3 and pool.counts[1, 6] == 1
    logits = torch.zeros(3, vocab)
    logits[:, 4], logits[:, 5], logits[:, 6] = 3.0, 2.9, 2.8
    info = info_for([rep, plain, freq], vocab, penalty_pool=pool, pool_rows=[1, 0, 3])
    processed = process_logits(logits.clone(), info)
    assert processed[0, 4] == 1.5 and processed[0, 6] == 1.4 and processed[0, 5] == 2.9  # prompt + output
    assert torch.equal(processed[1], logits[1])  # unpenalised row untouched
    assert processed[2, 5] == pytest.approx(2.9 - 3.0) and processed[2, 4] == 3.0  # prompt not counted
    assert sample(logits.clone(), info).next_token_ids.tolist() == [5, 4, 4]


def test_min_new_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(2, 8)
    logits[:, 2] = 10.0  # EOS
    logits[:, 3] = 9.0  # a stop token id
    params = [SP(temperature=0.0, min_new_tokens=3, stop_token_ids=(3,)), SP(temperature=0.0, min_new_tokens=3)]
    early = info_for(params, 8, output_lens=[2, 3], eos_token_ids=[2])
    assert sample(logits.clone(), early).next_token_ids.tolist() == [0, 2]
    done = early.with_step([3, 3])
    assert sample(logits.clone(), done).next_token_ids.tolist() == [2, 2]


def test_bitmask_matches_reference_and_restricts_sampling() -> None:
    xgrammar = pytest.importorskip("xgrammar")
    vocab, batch = 100, 3
    gen = torch.Generator().manual_seed(0)
    mask = xgrammar.allocate_token_bitmask(batch, vocab)  # all bits set: unconstrained
    mask[0] = 0
    mask[0, 1] = 1 << 5 | 1 << 9  # row 0 allows tokens 37 and 41 only
    mask[1, 0] = 0x0F0F0F0F
    logits = torch.randn(batch, vocab, generator=gen)
    a = process_logits(logits.clone(), info_for([SP()] * batch, vocab), vocab_mask=mask)
    assert torch.isinf(a[0]).sum() == vocab - 2 and torch.equal(a[2], logits[2])
    assert a[0, 37] == logits[0, 37] and a[0, 41] == logits[0, 41]
    greedy = sample(logits.clone(), info_for([SP(temperature=0.0)] * batch, vocab), vocab_mask=mask)
    assert greedy.next_token_ids[0] == (37 if logits[0, 37] >= logits[0, 41] else 41)
    drawn = run_masked(logits, mask, 200)
    assert set(drawn[:, 0].tolist()) <= {37, 41}
    allowed1 = {t for t in range(vocab) if t >= 32 or (t % 8) < 4}
    assert set(drawn[:, 1].tolist()) <= allowed1


def run_masked(logits: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    info = info_for([SP(temperature=2.0)] * logits.shape[0], logits.shape[1])
    return torch.stack([sample(logits.clone(), info, mask, gen).next_token_ids for _ in range(n)])


# -- logprobs ------------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_logits() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 64, generator=gen)
    pool = PenaltyPool(4, 64, "cpu")
    params = [SP(temperature=0.3, repetition_penalty=1.5), SP(temperature=0.0), SP(top_k=3)]
    pool.start(0, params[0], output_ids=list(range(32)))
    info = info_for(params, 64, penalty_pool=pool, pool_rows=[0, 1, 2], return_logprob=True, top_logprobs_num=4)
    out = sample(logits.clone(), info, generator=gen)
    raw = torch.log_softmax(logits, -1)
    assert out.next_logprobs is not None and out.top_ids is not None and out.top_vals is not None
    assert torch.allclose(out.next_logprobs, raw.gather(1, out.next_token_ids[:, None])[:, 0])
    vals, ids = raw.topk(4, -1)
    assert torch.equal(out.top_ids, ids) and torch.allclose(out.top_vals, vals)
    assert sample(logits[1:].clone(), info_for(params[1:], 64)).next_logprobs is None


def test_gather_logprobs_in_chunks() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(37, 50, generator=gen) * 10
    targets = torch.randint(0, 50, (37,), generator=gen)
    lp, top_ids, top_vals = gather_logprobs(logits, targets, top_k=3, chunk_elems=50 * 8)
    raw = torch.log_softmax(logits.double(), -1)
    assert torch.allclose(lp.double(), raw[torch.arange(37), targets], atol=1e-5)
    assert torch.equal(top_ids, raw.topk(3, -1).indices)
    assert top_vals.shape == (37, 3) and lp.dtype == torch.float32
    empty = gather_logprobs(logits[:0], targets[:0], top_k=2)
    assert empty[0].shape == (0,) and empty[1].shape == (0, 2)


# -- engine glue ---------------------------------------------------------------------------------


def fake_req(params: SamplingParams, row: int, out: list[int] | None = None, logprob: bool = False) -> Any:
    opts = LogprobOptions(return_logprob=logprob, top_logprobs_num=2 if logprob else 0)
    r = SimpleNamespace(params=params, req_pool_idx=row, prompt_ids=[1, 2], output_ids=out or [],
                        sample_index=0, logprob=opts)  # fmt: skip
    r.output_len = len(r.output_ids)
    return r


def batch_of(*reqs: Any) -> Any:
    return SimpleNamespace(items=[SimpleNamespace(req=r, samples=True, draft_ids=(), output_index=r.output_len)
                                  for r in reqs])


def test_sampler_build_for_caches_and_tracks_penalties() -> None:
    vocab = 6
    sampler = Sampler(vocab_size=vocab, max_rows=4, device="cpu", seed=0, eos_token_ids=[0])
    pen = fake_req(SP(temperature=0.0, presence_penalty=2.0), row=2, out=[4])
    plain = fake_req(SP(temperature=0.0, min_new_tokens=5), row=1, logprob=True)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 3.5]] * 2)
    for step in range(3):
        info = sampler.build_for(batch_of(pen, plain))
        assert info.return_logprob and info.top_logprobs_num == 2
        assert bool(info.penalty_starts) == (step == 0)  # counts built once from output_ids
        out = sampler.sample(logits.clone(), info)
        sampler.observe(info, out.next_token_ids)
        for r, t in zip((pen, plain), out.next_token_ids.tolist()):
            r.output_ids.append(t)
            r.output_len += 1
    assert pen.output_ids == [4, 5, 3, 2]  # each chosen token is penalised afterwards
    assert plain.output_ids == [4, 4, 4]
    assert sampler.penalty_pool.counts is not None
    assert sampler.penalty_pool.counts[2].tolist() == [0, 0, 1, 1, 1, 1]
    first = sampler.build_for(batch_of(pen, plain))
    assert sampler.build_for(batch_of(pen, plain)).temperatures is first.temperatures  # cached
    # A jump-forward appended a token the sampler never saw: the row is rebuilt from the ids.
    pen.output_ids.append(1)
    pen.output_len += 2  # (the one sampled for `first`, then the forced one)
    pen.output_ids.insert(-1, 0)
    assert sampler.build_for(batch_of(pen, plain)).penalty_starts[0][3] == tuple(pen.output_ids)
    assert math.isfinite(float(first.temperatures.sum()))
