"""Serving benchmark: Poisson arrivals at several request rates against an sgl server.

    python bench/serving.py                                  # launches `sgl serve` (default model)
    python bench/serving.py --rates 0.5,1,2 --num-requests 40 --output-len 32
    python bench/serving.py --url http://127.0.0.1:30000 --api-key KEY   # an existing server

Every request streams from /v1/completions (OpenAI protocol, so any compatible server can be
measured) with `ignore_eos` and a fixed `max_tokens`, so each produces exactly --output-len
tokens. Prompts are random words (distinct per request: the radix cache does not flatter
the numbers unless --shared-prefix is given). For each rate the benchmark reports time to
first token (TTFT), inter-token latency (ITL: gaps between streamed tokens) and end-to-end
latency, median and p99, plus achieved throughput; prints a table and appends one JSON line
per rate to bench/results/serving.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "serving.jsonl"
WORDS = ("river mountain quiet engine paper window garden silver thunder orange basket "
         "lantern forest morning candle pocket harbor violet marble shadow whisper tunnel "
         "meadow copper feather canyon ribbon glacier compass orchard velvet beacon").split()


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""


def make_prompts(n: int, words: int, shared_prefix: int, rng: random.Random) -> list[str]:
    prefix = " ".join(rng.choice(WORDS) for _ in range(shared_prefix))
    return [(prefix + " " if prefix else "") + " ".join(rng.choice(WORDS) for _ in range(words))
            for _ in range(n)]


async def one_request(client: httpx.AsyncClient, prompt: str, output_len: int) -> Result:
    payload = {"model": "default", "prompt": prompt, "max_tokens": output_len, "temperature": 0,
               "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    last, first, gaps, tokens = None, None, [], 0
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as response:
            if response.status_code != 200:
                return Result(False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if not event.get("choices") or not event["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
                tokens += 1
    except httpx.HTTPError as exc:
        return Result(False, error=f"{type(exc).__name__}: {exc}")
    if first is None:
        return Result(False, error="no tokens")
    return Result(True, ttft=first - start, e2e=last - start, gaps=gaps, tokens=tokens)


async def run_rate(url: str, headers: dict[str, str], prompts: list[str], rate: float, output_len: int,
                   rng: random.Random) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(one_request(client, prompt, output_len)))
            await asyncio.sleep(rng.expovariate(rate))  # Poisson process: exponential gaps
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft, e2e = [r.ttft for r in ok], [r.e2e for r in ok]
    gaps = [g for r in ok for g in r.gaps]
    ms = lambda v: round(v * 1000, 1)  # noqa: E731
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": round(duration, 2),
        "request_throughput": round(len(ok) / duration, 3),
        "output_throughput": round(sum(r.tokens for r in ok) / duration, 2),
        "ttft_ms_median": ms(statistics.median(ttft)) if ttft else None, "ttft_ms_p99": ms(pct(ttft, 0.99)),
        "itl_ms_median": ms(statistics.median(gaps)) if gaps else None, "itl_ms_p99": ms(pct(gaps, 0.99)),
        "e2e_ms_median": ms(statistics.median(e2e)) if e2e else None, "e2e_ms_p99": ms(pct(e2e, 0.99)),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
    }


def launch(args: argparse.Namespace) -> tuple[str, subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "sgl", "serve", "--port", str(port), *args.server_args.split()]
    if args.model:
        cmd += ["--model", args.model]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited ({process.returncode}); run the command by hand: {cmd}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url, process
        except httpx.HTTPError:
            time.sleep(0.5)
    process.terminate()
    raise SystemExit("the server did not become healthy in 300 s")


def machine() -> dict[str, Any]:
    return {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "python": platform.python_version()}


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="an existing server (default: launch `sgl serve`)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model for the launched server (default: the default model)")
    p.add_argument("--server-args", default="--max-total-tokens 16384", help="extra `sgl serve` flags")
    p.add_argument("--rates", default="0.5,1,2", help="request rates (req/s), comma-separated")
    p.add_argument("--num-requests", type=int, default=40, help="requests per rate")
    p.add_argument("--input-words", type=int, default=48, help="random words per prompt (~1.2 tokens each)")
    p.add_argument("--shared-prefix", type=int, default=0, help="words of a prefix shared by all prompts")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-save", action="store_true", help="do not append to bench/results/serving.jsonl")
    args = p.parse_args()

    process = None
    url = args.url
    if url is None:
        url, process = launch(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        info = httpx.get(url + "/get_model_info", headers=headers, timeout=30)
        model = info.json().get("model_path", "unknown") if info.status_code == 200 else "unknown"
        rng = random.Random(args.seed)
        # Warm up (first-request costs: allocator, grammar-free paths, thread pools).
        asyncio.run(run_rate(url, headers, make_prompts(2, 8, 0, rng), 100.0, 4, rng))
        rows = []
        for rate in [float(r) for r in args.rates.split(",")]:
            prompts = make_prompts(args.num_requests, args.input_words, args.shared_prefix, rng)
            results, duration = asyncio.run(run_rate(url, headers, prompts, rate, args.output_len, rng))
            rows.append((rate, summarize(results, duration)))
            print(f"rate {rate:g} req/s done: {rows[-1][1]['completed']} ok, {rows[-1][1]['failed']} failed",
                  file=sys.stderr, flush=True)
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)

    head = ("rate/s", "ok", "req/s", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "E2E p50", "E2E p99")
    print(f"\nmodel={model} requests/rate={args.num_requests} input~{args.input_words} words "
          f"output={args.output_len} tokens (latencies in ms)")
    print(" | ".join(f"{h:>9}" for h in head))
    for rate, s in rows:
        cells = (rate, s["completed"], s["request_throughput"], s["output_throughput"], s["ttft_ms_median"],
                 s["ttft_ms_p99"], s["itl_ms_median"], s["itl_ms_p99"], s["e2e_ms_median"], s["e2e_ms_p99"])
        print(" | ".join(f"{c:>9}" for c in cells))
    if args.no_save:
        return
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        for rate, s in rows:
            f.write(json.dumps({
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
                "commit": commit(), "model": model, "url": args.url or "launched",
                "workload": {"rate": rate, "num_requests": args.num_requests, "input_words": args.input_words,
                             "shared_prefix": args.shared_prefix, "output_len": args.output_len,
                             "server_args": None if args.url else args.server_args, "seed": args.seed},
                "figures": s}) + "\n")
    print(f"appended {len(rows)} lines to {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
