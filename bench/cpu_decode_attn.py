"""The CPU decode attention kernel alone (quant/cpu_ops.c `sgl_decode_attn`): one layer's
decode rows against their keys, read in place from a pool.

    python bench/cpu_decode_attn.py [--rows 32] [--keys 450] [--threads 1 2] [--repeats 50]
    python bench/cpu_decode_attn.py --prefill 512      # a prompt chunk: the C op vs SDPA
    python bench/cpu_decode_attn.py --avx2             # with the AVX-512 twins off

SmolLM2-135M's shape (9 query heads over 3 KV heads of 64), float16 and bfloat16 pools, each
request's keys at contiguous slots and at scattered ones. Prints ms per layer, the pool bytes
read per second, and x30 layers (a whole step's attention).

`--prefill N`: one request's N-token prompt chunk (no cached prefix), every token a query row
of the C op seeing keys 0 .. its position (what the engine's EXTEND steps run), against what
they ran before: the backend's SDPA extend path (`TorchAttentionBackend._attend_extend`: the
chunk's keys gathered from the pool, widened to float32, `F.scaled_dot_product_attention`).
"""

from __future__ import annotations

import argparse
import time

import torch

from sgl.backend.attention.torch_backend import TorchAttentionBackend, _ExtendRequest
from sgl.backend.quant import cpu_kernel, cpu_ops

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--keys", type=int, default=450)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--prefill", type=int, default=0, help="a prompt chunk of this many tokens")
    ap.add_argument("--avx2", action="store_true", help="the AVX-512 twins off")
    args = ap.parse_args()
    if args.avx2:
        cpu_kernel.use_avx512(False)
    if args.prefill:
        prefill(args)
        return
    gen = torch.Generator().manual_seed(0)
    rows, keys = args.rows, args.keys
    slots = max(40000, 2 * rows * keys)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen)
    lens = torch.full((rows,), keys, dtype=torch.int64)
    table_rows = torch.arange(rows)
    layouts = {"contiguous": torch.arange(rows * keys, dtype=torch.int32).view(rows, keys),
               "scattered": torch.randperm(slots, generator=gen)[:rows * keys].int().view(rows, keys)}
    pool_bytes = rows * keys * KV_HEADS * HEAD_DIM * 2 * 2  # K and V, 2 bytes each
    for dtype in (torch.float16, torch.bfloat16):
        k = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        for layout, table in layouts.items():
            for threads in args.threads:
                torch.set_num_threads(threads)
                for _ in range(3):
                    cpu_ops.decode_attention(q, k, v, table, table_rows, lens, HEAD_DIM ** -0.5)
                start = time.perf_counter()
                for _ in range(args.repeats):
                    cpu_ops.decode_attention(q, k, v, table, table_rows, lens, HEAD_DIM ** -0.5)
                sec = (time.perf_counter() - start) / args.repeats
                print(f"{str(dtype).removeprefix('torch.'):8} {layout:10} threads {threads}: "
                      f"{sec * 1e3:.2f} ms per layer, {pool_bytes / sec / 1e9:.1f} GB/s, "
                      f"x30 layers {sec * 30e3:.1f} ms", flush=True)


def timed(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def prefill(args: argparse.Namespace) -> None:
    gen = torch.Generator().manual_seed(0)
    n, scale = args.prefill, HEAD_DIM ** -0.5
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(n + 1, KV_HEADS, HEAD_DIM, generator=gen).half()
    v = torch.randn(n + 1, KV_HEADS, HEAD_DIM, generator=gen).half()
    table = torch.arange(1, n + 1, dtype=torch.int32)[None]  # slots 1..n (0 is reserved)
    rows, lens = torch.zeros(n, dtype=torch.int64), torch.arange(1, n + 1)
    out = torch.empty_like(q)

    def c_op() -> None:
        cpu_ops.decode_attention(q, k, v, table, rows, lens, scale, None, out)

    chunk = _ExtendRequest(0, n, table[0].long(), None)  # (no cached prefix: plain causal)

    def sdpa() -> None:
        TorchAttentionBackend._attend_extend(q, k, v, chunk, scale)

    for threads in args.threads:
        torch.set_num_threads(threads)
        times = {name: timed(fn, max(args.repeats // 5, 3)) for name, fn in (("C op", c_op), ("SDPA", sdpa))}
        print(f"prefill {n} tokens, threads {threads}: " + ", ".join(
            f"{name} {sec * 1e3:.2f} ms per layer (x30 {sec * 30e3:.0f} ms)" for name, sec in times.items())
            + f"; C op / SDPA {times['C op'] / times['SDPA']:.2f}", flush=True)


if __name__ == "__main__":
    main()
