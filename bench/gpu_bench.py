"""Issue 5's figures on one GPU, in one run: correctness, throughput against the floor, radix
cache, the feature ablation, overlap, memory, and transformers' `generate_batch` as the peer.

    python bench/gpu_bench.py [--scale 1.0] [--budget 540] [--only a,b,...] [--smoke]

Sections (in priority order; `--only` picks some): correct (GPU vs CPU greedy, bf16 logprobs
vs transformers), rates (measured bf16 matmul FLOP/s and copy bandwidth), main (Llama-3.1-8B
shape: KV capacity, single, fixed, mixed, shared-prefix, apps with every feature on), peer
(transformers generate_batch on reduced fixed/mixed sets, and ours on the same sets),
radix_off, ablation (apps: lpm->fcfs, chunked prefill off, overlap off, all off), small
(SmolLM2-135M shape: GPU idle fraction in decode, overlap on vs off on `mixed`), quant
(issue 14: 8B shape single stream and `fixed` with bf16, random 4-bit and FP8 weights;
`--only rates,quant` runs it alone; `--quant-engines bf16,det` compares bf16 with
`enable_deterministic_inference`, `bf16,kv_fp8` with a float8 KV cache).

Models have random weights of the real shapes (BENCH.md); requests are token ids with EOS
ignored, greedy. Request counts are scaled down from BENCH.md where the device budget demands
it; every table row says how many requests it ran. Every figure is printed and written as a
JSON line (bench/common.py `record`, and $OUT/gpu_bench.jsonl when $OUT is set).

The floor of a workload (BENCH.md): prompt FLOPs that must be computed (the ideal cache:
a shared prefix counts once) at the measured matmul rate, plus for every decode step the
weight bytes and the KV bytes read at the measured copy bandwidth. Decode steps are counted
as a lower bound: ceil(decode tokens / max batch), at least the longest output.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_sgl_importable  # noqa: E402

ensure_sgl_importable()

import torch  # noqa: E402

import sgl  # noqa: E402
from common import record as _record  # noqa: E402
from sgl.backend.layers.linear import unpacked_state_dict  # noqa: E402
from common import table  # noqa: E402

DEV = "cuda"  # the CPU is only for checking this script's logic (tests set it)
OUT = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
DEADLINE = [float("inf")]
ROWS: list[dict[str, Any]] = []
NOTES: list[str] = []


def record(model: str, workload: str, figures: dict[str, Any]) -> None:
    row = _record("gpu_bench", model, workload, figures)
    if OUT is not None:
        OUT.mkdir(parents=True, exist_ok=True)
        with open(OUT / "gpu_bench.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def note(text: str) -> None:
    print(text, flush=True)
    NOTES.append(text)


def left() -> float:
    return DEADLINE[0] - time.monotonic()


# -- workloads ------------------------------------------------------------------------------


@dataclass
class Request:
    ids: list[int]
    out: int
    shared: int = 0  # leading tokens shared with an earlier request (the ideal cache hit)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def w_single(vocab: int) -> list[Request]:
    return [Request(_ids(random.Random(0), 128, vocab), 512)]


def w_fixed(n: int, vocab: int, out: int = 256) -> list[Request]:
    rng = random.Random(0)
    return [Request(_ids(rng, 1024, vocab), out) for _ in range(n)]


def w_mixed(n: int, vocab: int) -> list[Request]:
    rng = random.Random(0)
    lens = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(n)]
    return [Request(_ids(rng, i, vocab), o) for i, o in lens]


def w_shared_prefix(groups: int, vocab: int, per_group: int = 16) -> list[Request]:
    rng = random.Random(0)
    reqs = []
    for _ in range(groups):
        prefix = _ids(rng, 2048, vocab)
        for j in range(per_group):
            reqs.append(Request(prefix + _ids(rng, 128, vocab), 256, shared=2048 if j else 0))
    return reqs


def w_apps(n: int, vocab: int, apps: int = 8) -> list[Request]:
    rng = random.Random(0)
    prompts = [_ids(rng, 2000, vocab) for _ in range(apps)]
    # Requests spread evenly over the apps, interleaved (app 0, 1, ..., 7, 0, 1, ...).
    return [Request(prompts[i % apps] + _ids(rng, 64, vocab), 128, shared=2000 if i >= apps else 0)
            for i in range(n)]


# -- measured machine rates and the floor --------------------------------------------------


@dataclass
class Rates:
    matmul_flops: float  # bf16 dense matmul, FLOP/s
    copy_bw: float  # device copy, bytes moved (read + write) per second


def _time_cuda(fn: Callable[[], Any], iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def measure_rates() -> Rates:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t_mm = _time_cuda(lambda: a @ b, 20)
    src = torch.empty(1 << 31, device="cuda", dtype=torch.uint8)  # 2 GiB
    dst = torch.empty_like(src)
    t_cp = _time_cuda(lambda: dst.copy_(src), 10)
    rates = Rates(2 * n**3 / t_mm, 2 * src.numel() / t_cp)
    del a, b, src, dst
    torch.cuda.empty_cache()
    return rates


@dataclass
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    inter: int
    tied: bool

    @classmethod
    def of(cls, mc: Any) -> Shape:
        return cls(mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                   mc.vocab_size, mc.hf_config.intermediate_size, mc.tie_word_embeddings)

    @property
    def layer_params(self) -> int:  # matmul weights of the decoder layers
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.layers * (self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.inter)

    @property
    def weight_bytes(self) -> int:  # bf16 bytes a decode step reads (layers + LM head)
        return 2 * (self.layer_params + self.vocab * self.hidden)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


def floor_seconds(reqs: list[Request], shape: Shape, rates: Rates, max_bs: int) -> float:
    flops = 0.0
    kv_bytes = 0.0
    decode_tokens = 0
    for r in reqs:
        p, new = len(r.ids), len(r.ids) - r.shared
        # matmuls of the computed prompt tokens, the LM head of the sampled row, and causal
        # attention (QK and PV: 4 * hidden FLOPs per layer per key) over positions shared..p
        flops += 2 * shape.layer_params * new + 2 * shape.hidden * shape.vocab
        flops += 4 * shape.layers * shape.heads * shape.head_dim * (p * (p + 1) - r.shared * (r.shared + 1)) / 2
        decode_tokens += r.out - 1
        # the k-th decode token reads the KV of p + k tokens
        kv_bytes += shape.kv_bytes_per_token * ((r.out - 1) * p + (r.out - 1) * r.out / 2)
    steps = max(math.ceil(decode_tokens / max_bs), max(r.out - 1 for r in reqs))
    return flops / rates.matmul_flops + (steps * shape.weight_bytes + kv_bytes) / rates.copy_bw


# -- running the engine ---------------------------------------------------------------------


def make_engine(model: str, **options: Any) -> sgl.Engine:
    t0 = time.monotonic()
    e = sgl.Engine(model=model, load_format="dummy", device=DEV, **options)
    rt = e._rt
    graphs = rt.runner.graphs
    print(f"  engine {model} {options}: ready in {time.monotonic() - t0:.1f} s "
          f"(graphs {len(rt.cuda_graph_sizes)} in {graphs.capture_seconds if graphs else 0:.1f} s, "
          f"KV pool {rt.kv_pool.allocator.capacity} tokens)", flush=True)
    return e


def close_engine(e: sgl.Engine | None) -> None:
    if e is None:
        return
    e.close()
    e._rt = None  # drop the runtime: weights, KV pool and graphs go with it
    del e
    gc.collect()
    torch.cuda.empty_cache()


async def _generate_all(e: sgl.Engine, reqs: list[Request]) -> list[Any]:
    return await asyncio.gather(*(e.generate(input_ids=r.ids, max_new_tokens=r.out, temperature=0,
                                             ignore_eos=True) for r in reqs))


def run(e: sgl.Engine, reqs: list[Request]) -> dict[str, Any]:
    e.flush_cache()
    before = e.stats()
    t0 = time.perf_counter()
    # A hang must cost one figure, not the whole (device-time limited) run.
    outs = asyncio.run(asyncio.wait_for(_generate_all(e, reqs), timeout=max(30.0, left())))
    wall = time.perf_counter() - t0
    after = e.stats()
    out_tokens = sum(len(o.token_ids) for o in outs)
    in_tokens = sum(len(r.ids) for r in reqs)
    assert out_tokens == sum(r.out for r in reqs), "EOS is ignored: every request runs to length"
    prompt = after.prompt_tokens - before.prompt_tokens
    cached = after.cached_tokens - before.cached_tokens
    return dict(requests=len(reqs), wall_s=wall, output_tok_s=out_tokens / wall,
                total_tok_s=(in_tokens + out_tokens) / wall, req_s=len(reqs) / wall,
                cache_hit=cached / prompt if prompt else 0.0,
                ideal_hit=sum(r.shared for r in reqs) / in_tokens,
                steps=after.steps - before.steps)


def warmup(e: sgl.Engine, vocab: int) -> None:
    rng = random.Random(1)
    # Lengths of every workload (Triton compiles a variant per integer specialization:
    # compile stalls must not land inside a timed run).
    reqs = [Request(_ids(rng, n, vocab), 8) for n in (300, 40, 1500, 9, 128, 1024, 2176, 2064, 16, 1)]
    asyncio.run(_generate_all(e, reqs))


def report(model: str, name: str, res: dict[str, Any], floor: float | None = None,
           **extra: Any) -> dict[str, Any]:
    row = dict(model=model, workload=name, **res, **extra)
    if floor is not None:
        row["floor_s"] = floor
        row["wall/floor"] = res["wall_s"] / floor
    ROWS.append(row)
    record(model, name, row)
    shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}
    print("  " + json.dumps(shown), flush=True)
    return row


# -- sections -------------------------------------------------------------------------------


def section_correct(args: argparse.Namespace) -> None:
    """GPU greedy == CPU greedy (float32, small random model); bf16 logprobs vs transformers."""
    small = {"num_hidden_layers": 4}
    cpu = sgl.Engine(model="smollm2-135m", load_format="dummy", device="cpu", dtype="float32",
                     model_config=small, max_total_tokens=8192)
    gpu = sgl.Engine(model="smollm2-135m", load_format="dummy", device=DEV, dtype="float32",
                     model_config=small, max_total_tokens=8192, max_running_requests=32)
    state = {k: v.to(DEV) for k, v in unpacked_state_dict(cpu._rt.runner.model).items()}
    gpu._rt.runner.model.load_state_dict(state)
    rng = random.Random(3)
    reqs = [Request(_ids(rng, rng.randint(5, 300), 49152), 8 + 4 * i) for i in range(8)]
    a = [o.token_ids for o in asyncio.run(_generate_all(cpu, reqs))]
    b = [o.token_ids for o in asyncio.run(_generate_all(gpu, reqs))]
    same = sum(x == y for x, y in zip(a, b))
    tokens_same = sum(p == q for x, y in zip(a, b) for p, q in zip(x, y))
    fig = dict(requests=len(reqs), identical_requests=same, identical_tokens=tokens_same,
               tokens=sum(len(x) for x in a), ok=same == len(reqs))
    note(f"GPU greedy vs CPU greedy (float32, SmolLM2 shape, 4 layers): {fig}")
    ROWS.append(dict(model="smollm2-135m/4L fp32", workload="gpu==cpu greedy", **fig))
    record("smollm2-135m-4L-fp32", "greedy-gpu-vs-cpu", fig)
    cpu.close()
    close_engine(gpu)

    # bf16 engine vs transformers on the same weights: prompt logprobs (extend path) and the
    # logprobs of the greedy outputs (CUDA-graph decode path).
    from transformers import AutoModelForCausalLM

    from sgl.backend.reference import unfused

    e = sgl.Engine(model="smollm2-135m", load_format="dummy", device=DEV, dtype="bfloat16",
                   max_total_tokens=1 << 16, max_running_requests=32)
    cfg = e._rt.model_config.hf_config
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(DEV).eval()
    missing, unexpected = hf.load_state_dict(unfused(e._rt.runner.model.state_dict(), cfg), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    rng = random.Random(4)
    prompts = [_ids(rng, n, cfg.vocab_size) for n in (17, 200, 640)]

    async def gen() -> list[Any]:
        return await asyncio.gather(*(e.generate(input_ids=p, max_new_tokens=24, temperature=0,
                                                 ignore_eos=True, return_logprob=True,
                                                 logprob_start_len=0) for p in prompts))

    outs = asyncio.run(gen())
    diffs_p, diffs_o, agree, total = [], [], 0, 0
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            seq = torch.tensor([p + o.token_ids], device=DEV)
            ref = torch.log_softmax(hf(seq).logits[0].float(), dim=-1)  # [L, V]
            ref_p = ref[torch.arange(len(p) - 1), seq[0, 1 : len(p)]]
            ours_p = _prompt_lps(o, len(p))
            diffs_p.append((ours_p - ref_p).abs())
            pos = torch.arange(len(p) - 1, len(p) - 1 + len(o.token_ids))
            ref_o = ref[pos, seq[0, len(p) :]]
            diffs_o.append((_output_lps(o) - ref_o).abs())
            agree += int((ref[pos].argmax(-1) == seq[0, len(p) :]).sum())
            total += len(o.token_ids)
    dp, do = torch.cat(diffs_p), torch.cat(diffs_o)
    fig = dict(prompt_lp_max_abs=float(dp.max()), prompt_lp_mean_abs=float(dp.mean()),
               output_lp_max_abs=float(do.max()), output_lp_mean_abs=float(do.mean()),
               greedy_top1_agreement=agree / total, tolerance_max_abs=0.1,
               ok=float(dp.max()) < 0.1 and float(do.max()) < 0.1)
    note(f"bf16 engine vs transformers logprobs (SmolLM2-135M shape): {fig}")
    ROWS.append(dict(model="smollm2-135m bf16", workload="logprobs vs transformers", **fig))
    record("smollm2-135m", "logprobs-vs-transformers", fig)
    del hf
    close_engine(e)


def _prompt_lps(o: Any, n: int) -> torch.Tensor:
    lps = o.logprobs.prompt  # one per prompt token after the first
    vals = [x.logprob for x in lps][-(n - 1):]
    return torch.tensor(vals, device=DEV, dtype=torch.float32)


def _output_lps(o: Any) -> torch.Tensor:
    return torch.tensor([x.logprob for x in o.logprobs.output], device=DEV, dtype=torch.float32)


def section_main(args: argparse.Namespace, rates: Rates, state: dict[str, Any]) -> None:
    s = args.scale
    free_before = torch.cuda.mem_get_info()[0]
    e = make_engine("llama3-8b")
    try:
        rt = e._rt
        shape = Shape.of(rt.model_config)
        vocab, max_bs = shape.vocab, rt.config.max_running_requests
        state["shape"], state["max_bs"] = shape, max_bs
        cap = rt.kv_pool.allocator.capacity
        mem = dict(free_gib_before_engine=free_before / 2**30,
                   kv_pool_gib=cap * shape.kv_bytes_per_token / 2**30, kv_pool_tokens=cap,
                   requests_of_2k_tokens=cap // 2048, max_running_requests=max_bs,
                   mem_fraction=rt.config.mem_fraction_static or 0.85,
                   cuda_graph_sizes=len(rt.cuda_graph_sizes))
        note(f"8B memory: {json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in mem.items()})}")
        record("llama3-8b", "memory", mem)
        warmup(e, vocab)
        reqs = w_single(vocab)
        report("llama3-8b", "single", run(e, reqs), floor_seconds(reqs, shape, rates, max_bs),
               target="output_tok_s >= 220")
        for name, reqs in (("fixed", w_fixed(max(8, int(512 * s)), vocab)),
                           ("mixed", w_mixed(max(8, int(256 * s)), vocab))):
            if left() < 60:
                note(f"skipped {name}: out of time")
                continue
            state[name] = report("llama3-8b", name, run(e, reqs), floor_seconds(reqs, shape, rates, max_bs),
                                 target="wall/floor <= 1.6")
        if left() > 60:
            reqs = w_shared_prefix(max(2, int(64 * s * args.prefix_scale)), vocab)
            state["shared_on"] = report("llama3-8b", "shared-prefix", run(e, reqs),
                                        floor_seconds(reqs, shape, rates, max_bs), radix=True)
        if left() > 60:
            reqs = w_apps(max(16, int(600 * s * args.apps_scale)), vocab)
            state["apps_reqs"] = reqs
            state["apps"] = {"all on": report("llama3-8b", "apps: all on", run(e, reqs),
                                              floor_seconds(reqs, shape, rates, max_bs))}
        if "peer" in args.sections:
            state["peer_ours"] = {}
            for name, reqs in peer_sets(vocab, args).items():
                state["peer_ours"][name] = report("llama3-8b", f"{name} (peer set, sgl)", run(e, reqs))
    finally:
        close_engine(e)


def peer_sets(vocab: int, args: argparse.Namespace) -> dict[str, list[Request]]:
    n = args.peer_requests
    mixed = w_mixed(n, vocab)
    return {"fixed": w_fixed(n, vocab, out=args.peer_out),
            "mixed": [Request(r.ids, min(r.out, args.peer_out)) for r in mixed]}


def section_peer(args: argparse.Namespace, state: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from sgl.backend.model_loader import _dummy_config

    cfg = _dummy_config("llama3-8b", None)
    t0 = time.monotonic()
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    print(f"  transformers model built in {time.monotonic() - t0:.1f} s", flush=True)
    for name, reqs in peer_sets(cfg.vocab_size, args).items():
        if left() < 40:
            note(f"skipped transformers {name}: out of time")
            break
        gen = GenerationConfig(max_new_tokens=max(r.out for r in reqs), do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        # generate_batch takes one max_new_tokens (the longest of the set): throughput counts
        # every token it produced.
        t1 = time.perf_counter()
        outs = hf.generate_batch(inputs=[r.ids for r in reqs], generation_config=gen)
        wall = time.perf_counter() - t1
        produced = sum(len(o.generated_tokens) for o in outs.values())
        res = dict(requests=len(reqs), wall_s=wall, output_tok_s=produced / wall,
                   output_tokens=produced)
        ours = state.get("peer_ours", {}).get(name)
        extra = {}
        if ours:
            extra = {"sgl_output_tok_s": ours["output_tok_s"],
                     "sgl/transformers": ours["output_tok_s"] / res["output_tok_s"]}
        report("llama3-8b", f"{name} (peer set, transformers generate_batch)", res, **extra)
    del hf
    gc.collect()
    torch.cuda.empty_cache()


def section_radix_off(args: argparse.Namespace, rates: Rates, state: dict[str, Any]) -> None:
    ensure_8b_state(args, state)
    e = make_engine("llama3-8b", disable_radix_cache=True)
    try:
        shape, max_bs = state["shape"], state["max_bs"]
        warmup(e, shape.vocab)
        if "shared_on" in state:
            reqs = w_shared_prefix(state["shared_on"]["requests"] // 16, shape.vocab)
            off = report("llama3-8b", "shared-prefix (radix off)", run(e, reqs), radix=False)
            on = state["shared_on"]
            note(f"shared-prefix: cache hit {on['cache_hit']:.3f} of prompt tokens vs ideal "
                 f"{on['ideal_hit']:.3f} ({on['cache_hit'] / on['ideal_hit']:.1%} of ideal); "
                 f"radix on/off throughput {on['output_tok_s'] / off['output_tok_s']:.2f}x "
                 f"(targets: >= 90% of ideal, >= 2x)")
        if "apps" in state and left() > 40:
            state["apps"]["radix off"] = report("llama3-8b", "apps: radix off",
                                                run(e, state["apps_reqs"]))
    finally:
        close_engine(e)


ABLATIONS: dict[str, dict[str, Any]] = {
    "lpm -> fcfs": dict(schedule_policy="fcfs"),
    "chunked prefill off": dict(chunked_prefill_size=-1),
    "overlap off": dict(disable_overlap_schedule=True),
    "all off": dict(disable_radix_cache=True, schedule_policy="fcfs", chunked_prefill_size=-1,
                    disable_overlap_schedule=True),
}


def ensure_8b_state(args: argparse.Namespace, state: dict[str, Any]) -> None:
    """Shape and request lists without the main section (a rerun of later sections only)."""
    if "shape" not in state:
        from sgl.backend.model_loader import load_model

        _, mc = load_model("llama3-8b", device=torch.device("meta"), dtype=torch.bfloat16)
        state["shape"], state["max_bs"] = Shape.of(mc), 256
    if "apps_reqs" not in state:
        state["apps_reqs"] = w_apps(max(16, int(600 * args.scale * args.apps_scale)), state["shape"].vocab)


def section_ablation(args: argparse.Namespace, state: dict[str, Any]) -> None:
    ensure_8b_state(args, state)
    configs = dict(ABLATIONS)
    if "apps" not in state:  # a rerun without the main section: measure "all on" here
        state["apps"] = {}
        configs = {"all on": {}, **configs}
    for name, opts in configs.items():
        if left() < 45:
            note(f"ablation '{name}' skipped: out of time")
            continue
        e = make_engine("llama3-8b", **opts)
        try:
            warmup(e, state["shape"].vocab)
            state["apps"][name] = report("llama3-8b", f"apps: {name}", run(e, state["apps_reqs"]))
        finally:
            close_engine(e)
    base = state["apps"].get("all on")
    if base is None:
        return
    rows = [dict(config=k, output_tok_s=v["output_tok_s"], total_tok_s=v["total_tok_s"],
                 cache_hit=v["cache_hit"], wall_s=v["wall_s"],
                 vs_all_on=v["output_tok_s"] / base["output_tok_s"])
            for k, v in state["apps"].items()]
    print(table(rows, ["config", "output_tok_s", "total_tok_s", "cache_hit", "wall_s", "vs_all_on"]))
    if "all off" in state["apps"]:
        note(f"apps ablation ({len(state['apps_reqs'])} requests): all on / all off = "
             f"{base['output_tok_s'] / state['apps']['all off']['output_tok_s']:.2f}x (model: ~2.8x)")


def section_small(args: argparse.Namespace, rates: Rates) -> None:
    res: dict[str, dict[str, Any]] = {}
    for overlap in (True, False):
        if left() < 30:
            note("small-model overlap run skipped: out of time")
            break
        e = make_engine("smollm2-135m", disable_overlap_schedule=not overlap)
        try:
            mc = e._rt.model_config
            shape, max_bs = Shape.of(mc), e._rt.config.max_running_requests
            warmup(e, mc.vocab_size)
            reqs = w_mixed(max(16, int(256 * args.scale)), mc.vocab_size)
            e._rt.runner.step_events = []
            cpu = cpu_split(e)
            r = run(e, reqs)
            events, e._rt.runner.step_events = e._rt.runner.step_events, None
            idle = {**idle_fraction(events), **{k: v / r["steps"] * 1e3 for k, v in cpu.items()}}
            name = f"mixed, overlap {'on' if overlap else 'off'}"
            res[name] = report("smollm2-135m", name, r, floor_seconds(reqs, shape, rates, max_bs), **idle)
        finally:
            close_engine(e)
    if len(res) == 2:
        on, off = res["mixed, overlap on"], res["mixed, overlap off"]
        note(f"SmolLM2-135M mixed: overlap on/off = {on['output_tok_s'] / off['output_tok_s']:.2f}x "
             f"(target >= 1.2x); GPU idle in steady decode with overlap on "
             f"{on['decode_idle_frac']:.1%} (target < 10%), off {off['decode_idle_frac']:.1%}")


def cpu_split(e: sgl.Engine) -> dict[str, float]:
    """Accumulated CPU seconds of each part of a step (reported as ms per step)."""
    rt = e._rt
    acc: dict[str, float] = {}

    def timed(obj: Any, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[key] = acc.get(key, 0.0) + time.perf_counter() - t

        setattr(obj, name, wrapper)

    timed(rt.scheduler, "schedule", "cpu_schedule_ms")
    timed(rt.runner, "prepare", "cpu_prepare_ms")
    timed(rt.runner, "_execute", "cpu_launch_ms")
    timed(rt.sampler, "build_for", "cpu_sampling_info_ms")
    timed(rt.scheduler, "update", "cpu_update_ms")
    return acc


def section_diag(args: argparse.Namespace, rates: Rates) -> None:
    """Where a single-stream 8B decode step goes: graph replay alone, and cuBLAS GEMVs."""
    e = make_engine("llama3-8b", max_running_requests=8)
    try:
        g = e._rt.runner.graphs
        vocab = e._rt.model_config.vocab_size
        warmup(e, vocab)
        e._rt.runner.step_events = []
        cpu = cpu_split(e)
        r = run(e, w_single(vocab))
        events, e._rt.runner.step_events = e._rt.runner.step_events, None
        extra = {**idle_fraction(events), **{k: v / r["steps"] * 1e3 for k, v in cpu.items()}}
        for bs in (1, 8):
            extra[f"graph_replay_ms_bs{bs}"] = _time_cuda(g.graphs[bs].replay, 50) * 1e3
        report("llama3-8b", "single (instrumented)", r, **extra)
        x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
        gemv = {}
        for name, n, k in (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                           ("down", 4096, 14336), ("lm_head", vocab, 4096)):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            xi = x if k == 4096 else torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            t = _time_cuda(lambda: torch.nn.functional.linear(xi, w), 50)
            gemv[f"{name}_us"] = t * 1e6
            gemv[f"{name}_TB_s"] = n * k * 2 / t / 1e12
            del w
        note(f"cuBLAS GEMV at batch 1 (bf16): {json.dumps({k: round(v, 2) for k, v in gemv.items()})}")
        record("llama3-8b", "gemv-bs1", gemv)
    finally:
        close_engine(e)


def idle_fraction(events: list[tuple[Any, Any, Any, int]]) -> dict[str, Any]:
    """GPU idle share between steps, from CUDA events around each step: over the whole run,
    and over runs of consecutive DECODE steps (steady decode)."""
    torch.cuda.synchronize()
    if len(events) < 3:
        return {}
    t0 = events[0][0]
    spans = [(t0.elapsed_time(s), t0.elapsed_time(e), mode.name, bs) for s, e, mode, bs in events]
    busy = sum(e - s for s, e, _, _ in spans)
    total = spans[-1][1] - spans[0][0]
    gaps = dec_busy = 0.0
    for (s0, e0, m0, _), (s1, e1, m1, _) in zip(spans, spans[1:]):
        if m0 == "DECODE" and m1 == "DECODE":
            gaps += max(0.0, s1 - e0)
            dec_busy += e1 - s1
    decode_steps = sum(1 for x in spans if x[2] == "DECODE")
    step_ms = sorted(e - s for s, e, m, _ in spans if m == "DECODE")
    return dict(idle_frac=1 - busy / total if total else 0.0,
                decode_idle_frac=gaps / (gaps + dec_busy) if dec_busy else 0.0,
                decode_steps=decode_steps,
                decode_step_ms_median=step_ms[len(step_ms) // 2] if step_ms else 0.0,
                decode_step_ms_mean=sum(step_ms) / len(step_ms) if step_ms else 0.0,
                wall_per_step_ms=total / len(spans))


# -- main -----------------------------------------------------------------------------------

QUANT_ENGINES = {"bf16": {}, "q4": dict(quantization="gguf"), "fp8": dict(quantization="fp8"),
                 "q4_bytes": dict(quantization="gguf"), "fp8_s9": dict(quantization="fp8"),
                 "fp8_nopdl": dict(quantization="fp8"),
                 "fp8_a8": dict(quantization="fp8", activation_quantization="fp8"),
                 # FP8 weight-only at every row count (the default before session 17)
                 "fp8_wo": dict(quantization="fp8", activation_quantization="none"),
                 "q4_l2": dict(quantization="gguf"),  # scratch slices of 16 MiB (variant)
                 "q4_triton": dict(quantization="gguf"),  # no CUDA GEMV: Triton (variant)
                 "q4_s19": dict(quantization="gguf"),  # the CUDA GEMV as session 19 left it
                 "q4_late": dict(quantization="gguf"),  # the CUDA GEMV never launched early
                 # Q4_K_M's mix: Q6_K v and down in about half the layers (install.RANDOM_LAYOUT)
                 "q4km": dict(quantization="gguf"), "q4km_s19": dict(quantization="gguf"),
                 # decode attention's splits merged by a second kernel, as session 22 left
                 # it (variants)
                 "q4_s22": dict(quantization="gguf"), "fp8_s22": dict(quantization="fp8"),
                 "bf16_s22": {},
                 # 4-bit products of K <= 4,096 at 1-2 rows capped to 3 programs per SM
                 # (min_blocks 3; since session 23 the default at one row), for
                 # bench/gpu_ab.py (variant); "q4_nocap": the default without the cap
                 "q4_cap": dict(quantization="gguf"), "q4_nocap": dict(quantization="gguf"),
                 # the small kernels not launched early, as session 23 left them
                 # (SMALL_EARLY_SWITCH, on since session 24: variants)
                 "q4_s23": dict(quantization="gguf"), "fp8_s23": dict(quantization="fp8"),
                 "bf16_s23": {},
                 # FP8 products of 4097-8192 rows (qkv) at one row on 2 warps by 1,024, as
                 # before session 25 (variant); step inputs read after the waits (variants)
                 "fp8_qkv_s24": dict(quantization="fp8"),
                 "q4_inlate": dict(quantization="gguf"), "fp8_inlate": dict(quantization="fp8"),
                 # when the GEMVs let the next kernel launch (variants)
                 "fp8_nolet": dict(quantization="fp8"), "fp8_letloop": dict(quantization="fp8"),
                 "fp8_letstart": dict(quantization="fp8"), "q4_letloop": dict(quantization="gguf"),
                 "det": dict(enable_deterministic_inference=True),  # bf16, batch-invariant
                 "kv_fp8": dict(kv_cache_dtype="fp8_e4m3")}  # bf16 weights, float8 KV
# the single-stream targets: every Q4 engine (and variant) 500 tok/s, every FP8 one 380
QUANT_TARGETS = {name: f"single output_tok_s >= {500 if name.startswith('q4') else 380}"
                 for name in QUANT_ENGINES if name.startswith(("q4", "fp8"))}


def config_fields(name: str) -> dict[str, int]:
    """The config fields a variant "kind:F=V[+F=V]" names, as integers."""
    return {field: int(value) for field, value in
            (item.split("=") for item in name.split(":", 1)[1].split("+"))}


@contextmanager
def engine_variant(name: str) -> Iterator[None]:
    """The code an engine of QUANT_ENGINES runs with, for the before of a before/after run:
    "q4_bytes" is "q4" on the first 4-bit GEMV kernel (unpack="bytes") with its session-6
    tiles (before the lop3 kernel, quant/triton_q4gemv.py); "fp8_s9" is "fp8" as session 9
    left it: the first FP8 GEMV kernel (fp8_decode="cvt") with its session-6 tiles and the LM
    head in bf16, no early launches (before the word kernel and the FP8 head); "fp8_nopdl" is
    "fp8" without the GEMVs' early launches (kernels/triton_compat.py); "q4_l2" is "q4" with
    the dequantize + cuBLAS path in 16 MiB scratch slices (bench/scratch_slices.py);
    "q4_triton" is "q4" with its products of 1-8 rows on the Triton kernels instead of the
    CUDA GEMV (quant/linear.py CUDA_GEMV); "q4_s19" is the CUDA GEMV as session 19 left it:
    4-bit codes only, one and two rows, never launched early; "q4_late" is "q4" without the
    CUDA GEMV's early launches (cuda_gemv.EARLY_LAUNCH); "q4km" and "q4km_s19" are "q4" and
    "q4_s19" on Q4_K_M's mix of formats (quant/install.py RANDOM_LAYOUT); "q4_s22", "fp8_s22"
    and "bf16_s22" merge decode attention's splits in stage 2's kernel instead of stage 1's
    last program (triton_attention_decode.MERGE_IN_STAGE1); "q4_cap" runs the 4-bit CUDA
    GEMVs of K <= 4,096 at one and two rows with min_blocks 3 (80 registers: 3 programs of 8
    warps per SM), "q4_nocap" none of them capped (cuda_gemv.SHORT_K: the default before
    session 23); "q4_s23", "fp8_s23" and "bf16_s23" launch the small kernels (RMSNorm,
    rotary + KV store, decode attention, SiLU x mul) as session 23 did, not early (off:
    triton_compat.SMALL_EARLY_SWITCH); "fp8_qkv_s24" runs the one-row FP8 products of
    4,097-8,192 rows (qkv) on the word kernel at 4 rows by 1,024 on 2 warps, the config before
    session 25 (4 by 512 on 4 warps now); "q4_inlate" and "fp8_inlate" read the RMSNorm's
    weight and rotary's and decode attention's step inputs after their waits, with no prefetch
    of attention's first tile (triton_compat.INPUTS_FIRST off; until session 26 the norm's
    weight had a switch of its own, "_normlate"); "fp8_nolet": the FP8 GEMVs never let the
    kernel after them launch early (triton_fp8.LET_NEXT "", as before session 25),
    "fp8_letloop" and "fp8_letstart" let it once their K loop is done or as a
    program starts; "q4_letloop": the CUDA GEMV lets it once its K loop is done, as before
    session 25 (CudaGemvConfig.let_next_at_start off); "q4_cfg:A[/B[/C]]" runs the one-row
    CUDA GEMVs on CudaGemvConfig(tiles, warps, span, min_blocks), each written T.W.S.B or "-"
    (the default): A the 4-bit ones of K <= cuda_gemv.SHORT_K, B the longer ones (A if not
    named), C the 8-bit ones (the head of the Q4 engine; the default if not named): an
    in-engine sweep (`bench/gpu_ab.py --variants q4,q4_cfg:1.8.2.3/1.8.2.0,...`);
    "fp8_cfg:A|B|C" replaces the rows of triton_gemv.GEMV_DEFAULTS["fp8"] (N <= 4,096, N <=
    8,192, the rest), each "rows.block_k.warps.decode[.stages]" (1 stage unless named) or "-"
    for the shipped one (`--variants fp8,fp8_cfg:4.2048.4.words|-|-`); "q4_gemv:F=V[+F=V]"
    sets CudaGemvConfig fields on every CUDA GEMV config the engine launches (after the
    defaults' rules: `q4_gemv:min_blocks=0` lifts SHORT_K's cap, `q4_gemv:min_blocks=2+span=1`
    sets two fields); "fp8_gemv:F=V[+F=V]" sets QGemvConfig fields on every row of the FP8
    one-row table (`fp8_gemv:num_stages=2`). The others: the shipped code.
    (The tables are read at capture and at eager calls; install_fp8 at load.)"""
    from sgl.backend.kernels.triton_compat import INPUTS_FIRST, PDL_SWITCH, SMALL_EARLY_SWITCH
    from sgl.backend.quant import install
    from sgl.backend.quant.triton_gemv import GEMV_DEFAULTS, QGemvConfig

    shipped, install_fp8 = dict(GEMV_DEFAULTS), install.install_fp8
    if name == "q4_bytes":
        GEMV_DEFAULTS["q4"] = ((8192, QGemvConfig(4, 1024, 4, magic=False)),
                               (1 << 62, QGemvConfig(8, 512, 4, magic=False)))
    elif name == "fp8_s9":
        GEMV_DEFAULTS["fp8"] = ((8192, QGemvConfig(8, 1024, 4, fp8_decode="cvt")),
                                (1 << 62, QGemvConfig(4, 1024, 4, fp8_decode="cvt")))
        install.install_fp8 = lambda model: install_fp8(model, head=False)
    elif name == "fp8_qkv_s24":  # (qkv's word kernel config before session 25)
        GEMV_DEFAULTS["fp8"] = tuple(
            (limit, QGemvConfig(4, 1024, 2, num_stages=1, fp8_decode="words") if limit == 8192
             else cfg) for limit, cfg in shipped["fp8"])
    elif name.startswith("fp8_cfg:"):  # (the one-row FP8 configs named, docstring)
        def fp8_config(word: str, shipped_cfg: QGemvConfig) -> QGemvConfig:
            if word == "-":
                return shipped_cfg
            rows, block_k, warps, decode, *stages = word.split(".")
            return QGemvConfig(int(rows), int(block_k), int(warps),
                               num_stages=int(stages[0]) if stages else 1, fp8_decode=decode)

        words = name.split(":", 1)[1].split("|")
        assert len(words) == len(shipped["fp8"]), f"{name}: one config per row of the table"
        GEMV_DEFAULTS["fp8"] = tuple((limit, fp8_config(word, cfg))
                                     for word, (limit, cfg) in zip(words, shipped["fp8"]))
    elif name.startswith("fp8_gemv:"):  # (fields of every FP8 one-row config, docstring)
        fields = config_fields(name)
        GEMV_DEFAULTS["fp8"] = tuple((limit, cfg._replace(**fields))
                                     for limit, cfg in shipped["fp8"])
    from sgl.backend.quant import linear

    scratch, cuda_q4 = linear.SCRATCH_ELEMENTS, linear.CUDA_GEMV
    if name == "q4_l2":
        linear.SCRATCH_ELEMENTS = 8 << 20
    linear.CUDA_GEMV = cuda_q4 and name != "q4_triton"
    from sgl.backend.quant import cuda_gemv

    cuda_early, cuda_rows, cuda_bits = (cuda_gemv.EARLY_LAUNCH, cuda_gemv.MAX_ROWS,
                                        cuda_gemv.BITS)
    mma_gemv = cuda_gemv.mma_gemv
    if name in ("q4_cap", "q4_nocap"):
        def capped(x: Any, w: Any, bias: Any = None, config: Any = None) -> Any:
            rows = x.numel() // w.in_features
            if config is None and w.bits == 4 and rows <= 2 and w.in_features <= cuda_gemv.SHORT_K:
                cap = 3 if name == "q4_cap" else 0
                config = cuda_gemv.default_config(rows, w)._replace(min_blocks=cap)
            return mma_gemv(x, w, bias, config)

        cuda_gemv.mma_gemv = capped
    elif name.startswith("q4_cfg:"):  # (the one-row 4-bit configs named, docstring)
        named = [None if c == "-" else cuda_gemv.CudaGemvConfig(*map(int, c.split(".")))
                 for c in name.split(":", 1)[1].split("/")]
        short, long, eight = (named + [named[0], None])[:3]

        def one_row(x: Any, w: Any, bias: Any = None, config: Any = None) -> Any:
            if config is None and x.numel() // w.in_features == 1:
                config = (eight if w.bits == 8 else
                          short if w.in_features <= cuda_gemv.SHORT_K else long)
            return mma_gemv(x, w, bias, config)

        cuda_gemv.mma_gemv = one_row
    elif name.startswith("q4_gemv:") or name == "q4_letloop":  # (fields of every config)
        fields = (config_fields(name) if name != "q4_letloop"
                  else {"let_next_at_start": False})

        def with_fields(x: Any, w: Any, bias: Any = None, config: Any = None) -> Any:
            config = config or cuda_gemv.default_config(x.numel() // w.in_features, w)
            return mma_gemv(x, w, bias, config._replace(**fields))

        cuda_gemv.mma_gemv = with_fields
    cuda_gemv.EARLY_LAUNCH = cuda_early and name not in ("q4_s19", "q4_late", "q4km_s19")
    if name in ("q4_s19", "q4km_s19"):
        cuda_gemv.MAX_ROWS, cuda_gemv.BITS = 2, (4,)
    layout = install.RANDOM_LAYOUT
    if name.startswith("q4km"):
        install.RANDOM_LAYOUT = "q4_k_m"
    early, small_early = PDL_SWITCH[0], SMALL_EARLY_SWITCH[0]
    PDL_SWITCH[0] = early and name not in ("fp8_s9", "fp8_nopdl")
    SMALL_EARLY_SWITCH[0] = small_early and not name.endswith("_s23")
    from sgl.backend.kernels import triton_attention_decode, triton_matmul

    inputs_first = INPUTS_FIRST[0]
    INPUTS_FIRST[0] = inputs_first and not name.endswith("_inlate")
    from sgl.backend.quant import triton_fp8

    fp8_let_next = triton_fp8.LET_NEXT[0]
    triton_fp8.LET_NEXT[0] = {"fp8_nolet": "", "fp8_letstart": "start",
                              "fp8_letloop": "loop"}.get(name, fp8_let_next)

    merge = triton_attention_decode.MERGE_IN_STAGE1[0]
    triton_attention_decode.MERGE_IN_STAGE1[0] = merge and not name.endswith("_s22")
    det_tile = dict(triton_matmul.TILE)
    if name == "det" and os.environ.get("DET_TILE"):  # a candidate of bench/det_linear.py
        tile = triton_matmul.MatmulTile(*map(int, os.environ["DET_TILE"].split("x")))
        triton_matmul.TILE[torch.bfloat16] = tile
        note(f"det: tile {tile}")
    try:
        yield
    finally:
        triton_matmul.TILE.update(det_tile)
        triton_attention_decode.MERGE_IN_STAGE1[0] = merge
        INPUTS_FIRST[0] = inputs_first
        triton_fp8.LET_NEXT[0] = fp8_let_next
        linear.SCRATCH_ELEMENTS = scratch
        linear.CUDA_GEMV = cuda_q4
        cuda_gemv.EARLY_LAUNCH, cuda_gemv.MAX_ROWS, cuda_gemv.BITS = (cuda_early, cuda_rows,
                                                                      cuda_bits)
        cuda_gemv.mma_gemv = mma_gemv
        install.RANDOM_LAYOUT = layout
        GEMV_DEFAULTS.update(shipped)
        install.install_fp8 = install_fp8
        PDL_SWITCH[0], SMALL_EARLY_SWITCH[0] = early, small_early


def quant_engine(name: str, opts: dict[str, Any], rates: Rates, shape: Shape,
                 fixed: list[Request] | None, single_runs: int = 3) -> dict[str, Any]:
    """One engine of the quant section: single stream (the median of `single_runs` runs, all
    of them listed: one run moved by ~5% between processes), then `fixed` (unless None) if
    time is left."""
    e = make_engine("llama3-8b", **opts)
    try:
        stats = e.stats()
        held = stats.weights_bytes
        warmup(e, shape.vocab)
        floor = held / rates.copy_bw  # one decode step streams every weight once
        runs = sorted((run(e, w_single(shape.vocab)) for _ in range(max(1, single_runs))),
                      key=lambda r: r["output_tok_s"])
        single = runs[len(runs) // 2]
        out = {"single": report("llama3-8b", f"single ({name})", single,
                                single_runs_tok_s=[round(r["output_tok_s"], 1) for r in runs],
                                weights_gib=held / 2**30, single_floor_tok_s=1 / floor,
                                kv_bytes_per_token=stats.kv_bytes_per_token,
                                kv_capacity_tokens=stats.kv_total_tokens,
                                target=QUANT_TARGETS.get(name, ""))}
        if fixed is not None and left() > 60:
            out["fixed"] = report("llama3-8b", f"fixed ({name})", run(e, fixed),
                                  weights_gib=held / 2**30)
        return out
    finally:
        close_engine(e)


def section_quant(args: argparse.Namespace, rates: Rates, state: dict[str, Any]) -> None:
    """Issue 14 on the GPU: the 8B shape with bf16, random 4-bit (quantization="gguf" on a
    dummy model: Q4_K-layout Linears, Q6_K-layout table and head, quant/install.py) and FP8
    weights (the untied head too), single stream and `fixed` throughput, each against bf16's.
    The single-stream floor counts the bytes the engine really holds (`weights_bytes`); the
    note names the kernel routes in force (quant/linear.py CUDA_ROUTES), so a figure can be
    traced to the path that produced it."""
    from sgl.backend.quant.linear import CUDA_ROUTES
    from sgl.backend.quant.triton_gemv import GEMV_DEFAULTS

    note(f"quant: CUDA_ROUTES {CUDA_ROUTES}")
    ensure_8b_state(args, state)
    shape, res = state["shape"], {}
    fixed = (w_fixed(max(8, int(512 * args.scale)), shape.vocab)
             if args.quant_fixed else None)
    for name in args.quant_engines.split(","):
        opts = QUANT_ENGINES[name]
        if left() < 90:
            note(f"quant: {name} skipped: out of time")
            continue
        with engine_variant(name):
            note(f"quant: {name}: GEMV tables q4 {GEMV_DEFAULTS['q4']}, fp8 {GEMV_DEFAULTS['fp8']}")
            res[name] = quant_engine(name, opts, rates, shape, fixed, args.single_runs)
    base = res.get("bf16", {})
    for name in ("q4_bytes", "q4_triton", "q4_s19", "q4_late", "q4_s22", "q4_s23", "q4",
                 "q4km_s19", "q4km", "q4_l2", "fp8_s9", "fp8_nopdl", "fp8_wo", "fp8_s22", "fp8_s23",
                 "fp8", "fp8_a8", "bf16_s22", "bf16_s23", "det", "kv_fp8"):
        for wl in ("single", "fixed"):
            if wl in res.get(name, {}) and wl in base:
                ratio = res[name][wl]["output_tok_s"] / base[wl]["output_tok_s"]
                target = QUANT_TARGETS.get(name)
                note(f"quant {name} {wl}: {res[name][wl]['output_tok_s']:.1f} tok/s, "
                     f"{ratio:.2f}x bf16 ({base[wl]['output_tok_s']:.1f})"
                     + ("" if target is None else " (issue: no worse than bf16)" if wl == "fixed"
                        else f" (issue: {target})"))


SECTIONS = ["correct", "rates", "main", "peer", "radix_off", "ablation", "small", "diag", "quant"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=0.5, help="request counts x this (fixed, mixed, ...)")
    ap.add_argument("--prefix-scale", type=float, default=0.25, help="shared-prefix groups: 64 x scale x this")
    ap.add_argument("--apps-scale", type=float, default=0.4, help="apps requests: 600 x scale x this")
    ap.add_argument("--peer-requests", type=int, default=16)
    ap.add_argument("--peer-out", type=int, default=128)
    ap.add_argument("--budget", type=float, default=540.0, help="seconds; later sections skip past it")
    ap.add_argument("--only", default=",".join(SECTIONS))
    ap.add_argument("--smoke", action="store_true", help="tiny counts: check that every section runs")
    ap.add_argument("--single-runs", type=int, default=3,
                    help="quant section: single-stream runs per engine (the median is reported)")
    ap.add_argument("--quant-engines", default="bf16,q4,fp8",
                    help=f"quant section's engines, in order, of {sorted(QUANT_ENGINES)} "
                         "(q4_bytes, fp8_s9: the befores of before/after runs, engine_variant)")
    ap.add_argument("--quant-no-fixed", dest="quant_fixed", action="store_false",
                    help="quant section: single streams only")
    args = ap.parse_args()
    args.sections = args.only.split(",")
    if args.smoke:
        args.scale, args.prefix_scale, args.apps_scale = 0.03, 1.0, 1.0
        args.peer_requests, args.peer_out = 2, 8
    DEADLINE[0] = time.monotonic() + args.budget
    print(f"gpu_bench on {torch.cuda.get_device_name(0)}, torch {torch.__version__}, args {vars(args)}",
          flush=True)
    state: dict[str, Any] = {}
    rates = Rates(790e12, 4.27e12)  # BENCH.md's figures until measured
    status = 0
    for name in SECTIONS:
        if name not in args.sections:
            continue
        if left() < 20:
            note(f"section {name} skipped: out of time")
            continue
        t0 = time.monotonic()
        print(f"\n== {name} ==", flush=True)
        try:
            if name == "correct":
                section_correct(args)
            elif name == "rates":
                rates = measure_rates()
                note(f"measured: bf16 matmul {rates.matmul_flops / 1e12:.0f} TFLOP/s, "
                     f"copy {rates.copy_bw / 1e12:.2f} TB/s")
                record("-", "rates", dict(matmul_tflops=rates.matmul_flops / 1e12,
                                          copy_tb_s=rates.copy_bw / 1e12))
            elif name == "main":
                section_main(args, rates, state)
            elif name == "peer":
                section_peer(args, state)
            elif name == "radix_off":
                section_radix_off(args, rates, state)
            elif name == "ablation":
                section_ablation(args, state)
            elif name == "diag":
                section_diag(args, rates)
            elif name == "small":
                section_small(args, rates)
            elif name == "quant":
                section_quant(args, rates, state)
        except Exception:
            status = 1
            traceback.print_exc()
            note(f"section {name} FAILED (traceback above)")
            gc.collect()
            torch.cuda.empty_cache()
        print(f"  ({name}: {time.monotonic() - t0:.1f} s)", flush=True)
    print("\n== all figures ==")
    cols = ["model", "workload", "requests", "output_tok_s", "total_tok_s", "wall_s", "floor_s",
            "wall/floor", "cache_hit", "ideal_hit", "sgl/transformers", "decode_idle_frac"]
    print(table([r for r in ROWS if "output_tok_s" in r], cols))
    print("\n".join(["", "== notes =="] + NOTES))
    return status


if __name__ == "__main__":
    sys.exit(main())
