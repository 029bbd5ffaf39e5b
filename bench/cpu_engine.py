"""The engine on the CPU with the default model, against transformers in the same run.

    python bench/cpu_engine.py [--single-tokens 128] [--batch 32] [--warm-cache]

Engine rows (each in a fresh process, one after the other, so that peak RSS is the row's own):
- sgl quantized: the CPU default, the GGUF's Q4_1/Q8_0 tensors kept quantized
  (backend/quant/), overlap on and off;
- sgl quantized over a float8 e4m3 KV cache (`kv_cache_dtype="fp8_e4m3"`, opt-in, lossy: a
  quarter of float32's KV bytes, half of the default float16's), no overlap;
- sgl quantized with `activation_quantization="int8"` (opt-in: integer dot products on the
  quantized weights, inputs rounded to int8 per group), no overlap;
- sgl float32: `quantization="none"`, the weights dequantized to float32 (the former default).
Each row reports single-stream and batch tok/s, the seconds until the engine was ready, and
the process's peak RSS after the single stream and then the batch. By default every row
starts from an empty cache folder (what a first `sgl.Engine()` meets, with the model file
already on disk: it is found, or downloaded, once before any row; the float row then
dequantizes the file first, the quantized one compiles its kernel); `--warm-cache` reuses
one folder, filled by a first untimed load of each kind.

Peer row, when `llama-cpp-python` is installed (it is not a dependency of sgl): llama.cpp on
the same GGUF file, in its own fresh process too, with torch's thread count; its Python API
runs one sequence per model, so the batch workload runs its requests one after another
("sequential": the figure is still requested output tokens / wall time).

Peer row at real concurrency, with `--llama-server PATH` (llama.cpp's `llama-server` binary,
built from its sources; llama-cpp-python's sdist carries them): the server on the same file
with torch's thread count and one slot per batch request (continuous batching, 1,024 tokens
of context per slot), the same greedy requests over its `/completion` endpoint (token ids,
EOS ignored, no prompt cache), all at once for the batch; ready is the time until its
`/health` answers, peak RSS the server process's own.

Workloads (fixed seeds, the same requests for every engine):
- single: one 128-token prompt, 128 new tokens (EOS ignored), prefill included, best of
  `--repeats` runs for each engine (the shared machine is noisy).
- batch: 32 requests, prompts uniform 64-512 tokens, outputs uniform 32-256 tokens (EOS
  ignored), all submitted at once: output tokens/s = requested output tokens / wall time.
  The transformers peer runs them as one left-padded batch to the longest output (what
  `generate` can do); only the requested tokens count for it too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record, table  # noqa: E402

import sgl  # noqa: E402
from sgl.backend.reference import load_reference_model  # noqa: E402

MODEL = "SmolLM2-135M-Instruct (Q4_1 GGUF)"
ENGINES: dict[str, dict[str, object]] = {
    "sgl quantized (overlap)": {"disable_overlap_schedule": False},
    "sgl quantized (no overlap)": {"disable_overlap_schedule": True},
    "sgl quantized, fp8_e4m3 KV (no overlap)": {"kv_cache_dtype": "fp8_e4m3",
                                                "disable_overlap_schedule": True},
    "sgl quantized, int8 activations (no overlap)": {"activation_quantization": "int8",
                                                     "disable_overlap_schedule": True},
    "sgl float32 (no overlap)": {"quantization": "none", "disable_overlap_schedule": True},
}


def workload(n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(64, 512))] for _ in range(n)]
    outs = [rng.randint(32, 256) for _ in range(n)]
    return prompts, outs


def peer_single(generate, args: argparse.Namespace) -> float:
    """A peer's single-stream figure: `generate(prompt, new)` once to warm up, then the best
    of `args.repeats` runs on the single-stream prompt, in tok/s."""
    rng = random.Random(1)
    prompt = [rng.randrange(100, 40000) for _ in range(128)]
    generate(prompt[:16], 4)
    best = 0.0
    for _ in range(args.repeats):
        t = time.perf_counter()
        generate(prompt, args.single_tokens)
        best = max(best, args.single_tokens / (time.perf_counter() - t))
    return best


def hf_single(model, prompt: list[int], new: int, repeats: int) -> float:
    best = 0.0
    with torch.inference_mode():
        model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, pad_token_id=2)  # warm-up
        for _ in range(repeats):
            t = time.perf_counter()
            model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=2)
            best = max(best, new / (time.perf_counter() - t))
    return best


def hf_padded_batch(model, prompts: list[list[int]], outs: list[int]) -> float:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=max(outs), min_new_tokens=max(outs),
                       do_sample=False, pad_token_id=2)
        return sum(outs) / (time.perf_counter() - t)


async def sgl_single(engine: sgl.Engine, prompt: list[int], new: int, repeats: int = 1) -> float:
    await engine.generate(input_ids=prompt[:16], max_new_tokens=4)  # warm-up
    engine.flush_cache()  # every repeat prefills the prompt, as transformers does
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        await engine.generate(input_ids=prompt, max_new_tokens=new, ignore_eos=True, temperature=0)
        best = max(best, new / (time.perf_counter() - t))
        engine.flush_cache()
    return best


async def sgl_batch(engine: sgl.Engine, prompts: list[list[int]], outs: list[int]) -> float:
    t = time.perf_counter()
    await asyncio.gather(*(engine.generate(input_ids=p, max_new_tokens=o, ignore_eos=True, temperature=0)
                           for p, o in zip(prompts, outs)))
    return sum(outs) / (time.perf_counter() - t)


def run_one(name: str, args: argparse.Namespace) -> dict[str, float]:
    """One engine row, in this (fresh) process: the figures as a dict."""
    rng = random.Random(1)
    single_prompt = [rng.randrange(100, 40000) for _ in range(128)]
    prompts, outs = workload(args.batch)
    t = time.perf_counter()
    engine = sgl.Engine(args.model, **ENGINES[name])
    ready = time.perf_counter() - t
    try:
        s = asyncio.run(sgl_single(engine, single_prompt, args.single_tokens, args.repeats))
        b = asyncio.run(sgl_batch(engine, prompts, outs))
        stats = engine.stats()
    finally:
        engine.close()
    return {"single": s, "batch": b, "ready s": ready, "peak RSS MB": stats.peak_rss_bytes / 2**20,
            "weights MB": stats.weights_bytes / 2**20, "KV touched MB": stats.kv_bytes_touched / 2**20}


LLAMA_CPP = "llama.cpp (sequential)"


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def run_llama_cpp(args: argparse.Namespace) -> dict[str, float]:
    """The llama.cpp peer row, in this (fresh) process: greedy, EOS ignored (we stop it)."""
    import resource

    from llama_cpp import Llama

    prompts, outs = workload(args.batch)
    t = time.perf_counter()
    llm = Llama(model_path=args.model, n_ctx=1024, n_batch=512,
                n_threads=torch.get_num_threads(), seed=0, verbose=False)
    ready = time.perf_counter() - t

    def generate(prompt: list[int], new: int) -> None:
        llm.reset()  # every run prefills its prompt (generate would reuse a cached prefix)
        # (a copy: generate reuses the list it is given; it never stops at EOS by itself)
        for count, _token in enumerate(llm.generate(list(prompt), temp=0.0, reset=True), 1):
            if count >= new:
                break

    single = peer_single(generate, args)
    t = time.perf_counter()
    for prompt, new in zip(prompts, outs):
        generate(prompt, new)
    batch = sum(outs) / (time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"single": single, "batch": batch, "ready s": ready, "peak RSS MB": peak / 2**20}


LLAMA_SERVER = "llama.cpp server (a slot per request)"


def run_llama_server(args: argparse.Namespace) -> dict[str, float]:
    """The llama.cpp server row: the server in a child process, driven from here."""
    import socket
    import urllib.error
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    prompts, outs = workload(args.batch)
    t = time.perf_counter()
    server = subprocess.Popen(
        [args.llama_server, "-m", args.model, "-np", str(args.batch), "-c",
         str(1024 * args.batch), "-t", str(torch.get_num_threads()), "--host", "127.0.0.1",
         "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"llama-server exited with {server.returncode}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.05)
        ready = time.perf_counter() - t

        def complete(prompt: list[int], new: int) -> None:
            body = json.dumps({"prompt": prompt, "n_predict": new, "temperature": 0,
                               "ignore_eos": True, "cache_prompt": False}).encode()
            request = urllib.request.Request(f"{url}/completion", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=1800) as reply:
                got = json.load(reply)
            if got["timings"]["predicted_n"] != new:
                raise RuntimeError(f"llama-server gave {got['timings']['predicted_n']} tokens, "
                                   f"not {new}")

        single = peer_single(complete, args)
        t = time.perf_counter()
        with ThreadPoolExecutor(args.batch) as pool:
            list(pool.map(complete, prompts, outs))
        batch = sum(outs) / (time.perf_counter() - t)
        status = Path(f"/proc/{server.pid}/status").read_text().split("\n")
        peak_kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    finally:
        server.terminate()
        server.wait(timeout=30)
    return {"single": single, "batch": batch, "ready s": ready, "peak RSS MB": peak_kb / 1024}


def spawn(name: str, args: argparse.Namespace, cache: str) -> dict[str, float]:
    """Run `name` in a child process with SGL_CACHE_DIR=cache; its figures."""
    cmd = [sys.executable, __file__, "--one", name, "--single-tokens", str(args.single_tokens),
           "--batch", str(args.batch), "--repeats", str(args.repeats), "--model", args.model]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "SGL_CACHE_DIR": cache})
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--single-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--warm-cache", action="store_true", help="reuse one cache folder (filled first)")
    ap.add_argument("--repeats", type=int, default=3, help="single stream: best of this many runs")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one engine row, print JSON
    ap.add_argument("--model", help="the GGUF file (default: the embedded default model, found "
                                    "or downloaded once before any timing)")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary: adds its row")
    args = ap.parse_args()
    if args.model is None:  # (outside the rows' fresh cache folders: a download is not a start)
        from sgl.backend.model_loader import resolve_model_path

        args.model = str(resolve_model_path(None))
    if args.one:
        got = run_llama_cpp(args) if args.one == LLAMA_CPP else run_one(args.one, args)
        print(json.dumps(got))
        return
    prompts, outs = workload(args.batch)
    batch_col = f"batch{args.batch} out tok/s"
    rows, figures = [], {}
    with tempfile.TemporaryDirectory() as shared:
        if args.warm_cache:  # fill the cache with both kinds, untimed
            for options in ({}, {"quantization": "none"}):
                os.environ["SGL_CACHE_DIR"] = shared
                sgl.Engine(args.model, **options).close()
        names = [*ENGINES, *([LLAMA_CPP] if llama_cpp_available() else []),
                 *([LLAMA_SERVER] if args.llama_server else [])]
        for name in names:
            cache = shared if args.warm_cache else tempfile.mkdtemp(prefix="sgl-bench-")
            got = run_llama_server(args) if name == LLAMA_SERVER else spawn(name, args, cache)
            rows.append({"engine": name, "single tok/s": got["single"], batch_col: got["batch"],
                         "ready s": got["ready s"], "peak RSS MB": got["peak RSS MB"]})
            figures.update({f"{name} {key}": value for key, value in got.items()})
    for peer in (LLAMA_CPP, LLAMA_SERVER):  # sgl's best rows against llama.cpp on the same file
        if peer in names:
            tag = "llama.cpp" if peer == LLAMA_CPP else "llama-server"
            for key in ("single", "batch"):
                figures[f"{key} ratio vs {tag}"] = (max(figures[f"{n} {key}"] for n in ENGINES)
                                                    / figures[f"{peer} {key}"])

    if not args.skip_hf:
        rng = random.Random(1)
        single_prompt = [rng.randrange(100, 40000) for _ in range(128)]
        ref = load_reference_model()
        s = hf_single(ref, single_prompt, args.single_tokens, args.repeats)
        b = hf_padded_batch(ref, prompts, outs)
        rows.append({"engine": "transformers generate", "single tok/s": s, batch_col: b})
        figures["hf single"] = s
        figures["hf padded batch"] = b
        best = max(figures[f"{n} single"] for n in ENGINES)
        figures["single ratio vs hf"] = best / s
        figures["batch ratio vs hf"] = max(figures[f"{n} batch"] for n in ENGINES) / b

    print(table(rows, ["engine", "single tok/s", batch_col, "ready s", "peak RSS MB"]))
    if "single ratio vs hf" in figures:
        print(f"single-stream ratio vs transformers: {figures['single ratio vs hf']:.2f}x; "
              f"batch ratio: {figures['batch ratio vs hf']:.2f}x")
    record("cpu_engine", MODEL, f"single {args.single_tokens} / batch {args.batch} mixed", figures)


if __name__ == "__main__":
    main()
