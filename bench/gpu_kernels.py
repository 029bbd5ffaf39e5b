"""GPU kernel check and timing at Llama-3-8B shapes: every Triton kernel against its reference.

    python bench/gpu_kernels.py [--quick] [--json PATH]

For each op and shape: the max error of the Triton kernel against the pure-torch reference
(normalized by the reference's largest magnitude; bf16 passes under 2e-2), then times from
`triton.testing.do_bench` for the kernel, the reference (pointwise ops), and a dense PyTorch
SDPA peer for attention (contiguous K/V, no pool indirection: an upper bound to compare with).
Decode also runs through a captured CUDA graph (the engine's path), with the lengths changed
between capture and replay to check the graph-safety claim. Prints a table, appends one JSON
line per run. Exit status 1 if any check fails.

Self-contained: needs torch + triton (no xgrammar, gguf, transformers, or an installed sgl).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import traceback
import types
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, VOCAB = 32, 8, 128, 4096, 14336, 128256
DTYPE = torch.bfloat16
DEV = torch.device("cuda")


sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_sgl_importable  # noqa: E402

ensure_sgl_importable()
from sgl.backend.kernels import (  # noqa: E402
    activation, attention_decode, attention_extend, kv_store, rmsnorm, rotary, token_bitmask,
    triton_activation, triton_attention_decode, triton_attention_extend, triton_kv_store,
    triton_rmsnorm, triton_rotary, triton_token_bitmask,
)

K = types.SimpleNamespace(
    activation=activation, decode=attention_decode, extend=attention_extend,
    kv_store=kv_store, rmsnorm=rmsnorm, rotary=rotary, bitmask=token_bitmask,
)
ROWS: list[dict[str, Any]] = []


def bench_ms(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50))


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.float(), expected.float()
    finite = torch.isfinite(e)
    if not torch.equal(finite, torch.isfinite(a)):
        return float("inf")
    scale = e[finite].abs().max().clamp_min(1e-6)
    return float(((a - e)[finite]).abs().max() / scale) if finite.any() else 0.0


def record(op: str, shape: str, err: float, triton_ms: float, ref_ms: float | None = None,
           peer_ms: float | None = None, figure: str = "", tol: float = 2e-2) -> None:
    ROWS.append(dict(op=op, shape=shape, err=err, ok=err <= tol, triton_ms=triton_ms,
                     ref_ms=ref_ms, peer_ms=peer_ms, figure=figure))


def run_case(op: str, shape: str, body: Callable[[], None]) -> None:
    try:
        body()
    except Exception as exc:  # keep going: one broken case must not hide the others
        traceback.print_exc()
        ROWS.append(dict(op=op, shape=shape, err=float("nan"), ok=False, triton_ms=None,
                         ref_ms=None, peer_ms=None, figure=f"ERROR {type(exc).__name__}"))
    torch.cuda.empty_cache()


def randn(*shape: int, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    return torch.randn(*shape, device=DEV, dtype=dtype)


# --------------------------------------------------------------------------- pointwise ops


def pointwise_cases(token_counts: list[int]) -> None:
    for t in token_counts:
        def norm(t: int = t) -> None:
            x, r, w = randn(t, HIDDEN), randn(t, HIDDEN), randn(HIDDEN)
            got = triton_rmsnorm.fused_add_rmsnorm_triton(x, r, w)
            exp = K.rmsnorm.fused_add_rmsnorm_reference(x, r, w)
            err = max(rel_err(got[0], exp[0]), rel_err(got[1], exp[1]))
            record("fused_add_rmsnorm", f"T={t} h={HIDDEN}", err,
                   bench_ms(lambda: triton_rmsnorm.fused_add_rmsnorm_triton(x, r, w)),
                   bench_ms(lambda: K.rmsnorm.fused_add_rmsnorm_reference(x, r, w)))

        def rope(t: int = t) -> None:
            cache = K.rotary.make_cos_sin_cache(8192, HEAD_DIM, 5e5, device=DEV)
            pos = torch.randint(0, 8192, (t,), device=DEV)
            q, k = randn(t, HEADS, HEAD_DIM), randn(t, KV_HEADS, HEAD_DIM)
            got = triton_rotary.rotary_embedding_triton(pos, q, k, cache)
            exp = K.rotary.rotary_embedding_reference(pos, q, k, cache)
            err = max(rel_err(got[0], exp[0]), rel_err(got[1], exp[1]))
            record("rotary (out of place)", f"T={t} H=32/8 D=128", err,
                   bench_ms(lambda: triton_rotary.rotary_embedding_triton(pos, q, k, cache, True)),
                   bench_ms(lambda: K.rotary.rotary_embedding_reference(pos, q, k, cache)))

        def silu(t: int = t) -> None:
            x = randn(t, 2 * INTER)
            err = rel_err(triton_activation.silu_and_mul_triton(x),
                          K.activation.silu_and_mul_reference(x))
            ms = bench_ms(lambda: triton_activation.silu_and_mul_triton(x))
            gbs = 3 * t * INTER * 2 / ms / 1e6
            record("silu_and_mul", f"T={t} I={INTER}", err, ms,
                   bench_ms(lambda: K.activation.silu_and_mul_reference(x)), figure=f"{gbs:.0f} GB/s")

        def store(t: int = t) -> None:
            slots = 1 << 16
            kb, vb = randn(slots, KV_HEADS, HEAD_DIM), randn(slots, KV_HEADS, HEAD_DIM)
            k, v = randn(t, KV_HEADS, HEAD_DIM), randn(t, KV_HEADS, HEAD_DIM)
            loc = torch.randperm(slots - 1, device=DEV)[:t] + 1
            kb2, vb2 = kb.clone(), vb.clone()
            triton_kv_store.kv_store_triton(kb, vb, k, v, loc)
            K.kv_store.kv_store_reference(kb2, vb2, k, v, loc)
            err = 0.0 if torch.equal(kb, kb2) and torch.equal(vb, vb2) else float("inf")
            record("kv_store", f"T={t} KVH=8 D=128", err,
                   bench_ms(lambda: triton_kv_store.kv_store_triton(kb, vb, k, v, loc)),
                   bench_ms(lambda: K.kv_store.kv_store_reference(kb, vb, k, v, loc)))

        for name, body in (("rmsnorm", norm), ("rotary", rope), ("silu", silu), ("kv", store)):
            run_case(name, f"T={t}", body)

    def bitmask() -> None:
        rows, words = 256, -(-VOCAB // 32)
        logits = randn(rows, VOCAB, dtype=torch.float32)
        mask = torch.randint(-(2**31), 2**31 - 1, (rows, words), device=DEV, dtype=torch.int32)
        a, b = logits.clone(), logits.clone()
        triton_token_bitmask.apply_token_bitmask_triton(a, mask)
        K.bitmask.apply_token_bitmask_reference(b, mask)
        record("apply_token_bitmask", f"B={rows} V={VOCAB}", 0.0 if torch.equal(a, b) else 1.0,
               bench_ms(lambda: triton_token_bitmask.apply_token_bitmask_triton(a, mask)),
               bench_ms(lambda: K.bitmask.apply_token_bitmask_reference(b, mask)))

    run_case("apply_token_bitmask", "", bitmask)


# --------------------------------------------------------------------------- attention


def make_pool(seq_lens: list[int], page_size: int = 16) -> types.SimpleNamespace:
    """Shuffled paged pool (page 0 reserved); request b at row b + 1 of req_to_token."""
    pages = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages) + 1
    order = torch.randperm(num_pages - 1, device=DEV) + 1
    req_to_token = torch.zeros(len(seq_lens) + 1, max(seq_lens), dtype=torch.int32, device=DEV)
    offset = 0
    for b, n in enumerate(seq_lens):
        mine = order[offset : offset + pages[b]]
        offset += pages[b]
        slots = (mine[:, None] * page_size + torch.arange(page_size, device=DEV)).flatten()[:n]
        req_to_token[b + 1, :n] = slots.int()
    num_slots = num_pages * page_size
    return types.SimpleNamespace(
        k=randn(num_slots, KV_HEADS, HEAD_DIM), v=randn(num_slots, KV_HEADS, HEAD_DIM),
        req_to_token=req_to_token, rows=torch.arange(1, len(seq_lens) + 1, device=DEV),
    )


def dense_kv(pool: types.SimpleNamespace, batch: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    slots = pool.req_to_token[1 : batch + 1, :ctx].long()  # [B, L]
    k = pool.k[slots].transpose(1, 2).contiguous()  # [B, KVH, L, D]
    v = pool.v[slots].transpose(1, 2).contiguous()
    return k, v


def decode_case(batch: int, ctx: int) -> None:
    pool = make_pool([ctx] * batch)
    q = randn(batch, HEADS, HEAD_DIM)
    lens = torch.full((batch,), ctx, device=DEV)
    scale = HEAD_DIM**-0.5
    splits = triton_attention_decode.decode_num_kv_splits(batch, KV_HEADS,
                                           torch.cuda.get_device_properties(0).multi_processor_count)
    args = (pool.req_to_token, pool.rows, lens, scale)
    got = triton_attention_decode.decode_attention_triton(q, pool.k, pool.v, *args, splits)
    err = rel_err(got, K.decode.decode_attention_reference(q, pool.k, pool.v, *args))
    ms = bench_ms(lambda: triton_attention_decode.decode_attention_triton(q, pool.k, pool.v, *args, splits))
    kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * q.element_size()
    peer = None
    if batch * ctx <= 256 * 4096:
        dk, dv = dense_kv(pool, batch, ctx)
        qd = q[:, :, None, :]  # [B, H, 1, D]
        peer = bench_ms(lambda: F.scaled_dot_product_attention(qd, dk, dv, enable_gqa=True))
        del dk, dv
    record("decode_attention", f"B={batch} ctx={ctx} splits={splits}", err, ms, None, peer,
           f"{kv_bytes / ms / 1e9:.2f} TB/s KV")


def decode_graph_case(batch: int, ctx: int) -> None:
    """Capture kv_store + decode in a CUDA graph, then replay with other lengths and slots."""
    pool = make_pool([ctx + 64] * batch)
    scale = HEAD_DIM**-0.5
    splits = triton_attention_decode.decode_num_kv_splits(batch, KV_HEADS,
                                           torch.cuda.get_device_properties(0).multi_processor_count)
    q, k, v = randn(batch, HEADS, HEAD_DIM), randn(batch, KV_HEADS, HEAD_DIM), randn(batch, KV_HEADS, HEAD_DIM)
    lens = torch.full((batch,), ctx, device=DEV)
    loc = torch.zeros(batch, dtype=torch.long, device=DEV)

    def step() -> torch.Tensor:
        triton_kv_store.kv_store_triton(pool.k, pool.v, k, v, loc)
        return triton_attention_decode.decode_attention_triton(q, pool.k, pool.v, pool.req_to_token, pool.rows,
                                                lens, scale, splits)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm up (compile) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    # New data in the same static tensors: varied lengths, the new token's slot at len - 1.
    new_lens = torch.randint(1, ctx + 64, (batch,), device=DEV)
    lens.copy_(new_lens)
    loc.copy_(pool.req_to_token[pool.rows, new_lens - 1].long())
    q.copy_(randn(batch, HEADS, HEAD_DIM))
    graph.replay()
    exp_k, exp_v = pool.k.clone(), pool.v.clone()
    K.kv_store.kv_store_reference(exp_k, exp_v, k, v, loc)
    exp = K.decode.decode_attention_reference(q, exp_k, exp_v, pool.req_to_token, pool.rows,
                                              lens, scale)
    err = rel_err(out, exp)
    if not (torch.equal(pool.k[loc], k) and torch.equal(pool.v[loc], v)):
        err = float("inf")  # the captured kv_store did not write the new slots
    ms = bench_ms(graph.replay)
    record("decode (CUDA graph replay)", f"B={batch} ctx<={ctx + 63} +kv_store", err, ms,
           figure="lengths changed after capture")


def extend_case(batch: int, prefix: int, new: int) -> None:
    seq = prefix + new
    pool = make_pool([seq] * batch)
    q = randn(batch * new, HEADS, HEAD_DIM)
    t = lambda v: torch.tensor(v, device=DEV)  # noqa: E731
    args = (pool.req_to_token, pool.rows, t([seq] * batch), t([prefix] * batch),
            t([new] * batch), t([b * new for b in range(batch)]), HEAD_DIM**-0.5, new)
    got = triton_attention_extend.extend_attention_triton(q, pool.k, pool.v, *args)
    err = rel_err(got, K.extend.extend_attention_reference(q, pool.k, pool.v, *args))
    ms = bench_ms(lambda: triton_attention_extend.extend_attention_triton(q, pool.k, pool.v, *args))
    # Causal FLOPs: query i attends prefix + i + 1 keys; 4 flops per (q, k, dim): QK and PV.
    keys = batch * (new * prefix + new * (new + 1) / 2)
    tflops = 4 * keys * HEADS * HEAD_DIM / ms / 1e9
    peer = None
    if prefix == 0:  # the dense peer: SDPA causal over contiguous K/V (flash kernel)
        dk, dv = dense_kv(pool, batch, seq)
        qd = q.view(batch, new, HEADS, HEAD_DIM).transpose(1, 2)
        peer = bench_ms(lambda: F.scaled_dot_product_attention(qd, dk, dv, is_causal=True,
                                                               enable_gqa=True))
    record("extend_attention", f"B={batch} prefix={prefix} new={new}", err, ms, None, peer,
           f"{tflops:.0f} TFLOP/s")


# --------------------------------------------------------------------------- main


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:9.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    default_json = Path(os.environ.get("OUT", ROOT / "bench")) / "gpu_kernels.jsonl"
    parser.add_argument("--json", type=Path, default=default_json)
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    torch.manual_seed(0)
    import triton

    pointwise_cases([1, 256] if opts.quick else [1, 256, 8192])
    decode_shapes = ([(1, 1024), (64, 4096)] if opts.quick else
                     [(1, 1024), (1, 8192), (8, 4096), (32, 2048), (64, 4096), (128, 1024),
                      (256, 1024), (256, 4096), (256, 8192)])
    for batch, ctx in decode_shapes:
        run_case("decode_attention", f"B={batch} ctx={ctx}", lambda b=batch, c=ctx: decode_case(b, c))
    for batch, ctx in [(1, 4096), (64, 1024)] if opts.quick else [(1, 8192), (64, 1024), (256, 2048)]:
        run_case("decode graph", f"B={batch}", lambda b=batch, c=ctx: decode_graph_case(b, c))
    extend_shapes = ([(1, 0, 1024), (4, 2048, 512)] if opts.quick else
                     [(1, 0, 1024), (1, 0, 8192), (8, 0, 1024), (4, 2048, 1024), (16, 4000, 64),
                      (1, 7000, 1024)])
    for batch, prefix, new in extend_shapes:
        run_case("extend_attention", f"B={batch} prefix={prefix} new={new}",
                 lambda b=batch, p=prefix, n=new: extend_case(b, p, n))

    device = torch.cuda.get_device_name(0)
    print(f"\n{device}  torch {torch.__version__}  triton {triton.__version__}  bf16, "
          f"8B shapes (H={HEADS}, KVH={KV_HEADS}, D={HEAD_DIM})")
    head = f"{'op':28} {'shape':36} {'rel err':>8} {'ok':>4} {'triton us':>9} {'ref us':>9} {'peer us':>9}  figure"
    print(head + "\n" + "-" * len(head))
    for r in ROWS:
        print(f"{r['op']:28} {r['shape']:36} {r['err']:8.1e} {'yes' if r['ok'] else 'NO':>4} "
              f"{fmt(r['triton_ms'])} {fmt(r['ref_ms'])} {fmt(r['peer_ms'])}  {r['figure']}")
    print("peer: torch SDPA on dense contiguous K/V (decode: enable_gqa; extend: causal, no prefix)")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip() or None
    except OSError:
        commit = None
    line = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), machine=device,
                commit=commit, bench="gpu_kernels", torch=torch.__version__,
                triton=triton.__version__, rows=ROWS)
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    with opts.json.open("a") as f:
        f.write(json.dumps(line) + "\n")
    failed = [r for r in ROWS if not r["ok"]]
    print(f"\n{len(ROWS) - len(failed)}/{len(ROWS)} checks passed; JSON line appended to {opts.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
