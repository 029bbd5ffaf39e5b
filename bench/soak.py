"""Soak: a server under mixed load for a set time, with clients that disconnect at random.

    python bench/soak.py --duration 180                  # starts `python -m sgl serve` itself
    python bench/soak.py --url http://127.0.0.1:30000    # an already running server
    python bench/soak.py --in-process --duration 60      # sgl.Engine in this process, no HTTP

Clients loop, each sending one request at a time to /generate: text prompts of mixed lengths,
streamed or not, greedy or sampled, now and then a bad request (which must get a 4xx). A share
of the requests is abandoned half-way (`--disconnect`): a streamed one after a few chunks, a
plain one by a client-side timeout; the server must abort them and free their KV.

Reported (stdout, and one JSON line appended to bench/results/soak.jsonl): requests served,
disconnected, rejected (4xx), server errors (5xx) and transport errors; output tokens; KV
usage sampled over time; the server's RSS over time and its peak (VmHWM). At the end, once the
clients stop, the engine must drain: nothing running or waiting, and every used KV slot held
by the radix cache (no request-owned slot leaked). The server is started with
--debug-integrity, so the engine also checks pool and tree whenever it is idle.

This is a benchmark, not a test: it runs for minutes and its figures go to docs/operations.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "soak.jsonl"

WORDS = ("the a river mountain quickly system engine token cache memory request answer question "
         "because however seven blue history science music garden window letter future simple").split()


@dataclass
class Counts:
    served: int = 0  # completed with a 200 and a final output
    disconnected: int = 0  # abandoned by the client on purpose
    rejected: int = 0  # bad requests sent on purpose that got a 4xx
    unexpected_4xx: int = 0  # good requests that got a 4xx
    bad_accepted: int = 0  # bad requests that did not get a 4xx
    server_errors: int = 0  # 5xx
    transport_errors: int = 0  # connection failures other than our own disconnects
    output_tokens: int = 0
    latencies: list[float] = field(default_factory=list)


def prompt_text(rng: random.Random) -> str:
    n = rng.choice([rng.randint(3, 20), rng.randint(20, 120), rng.randint(120, 400)])
    return " ".join(rng.choice(WORDS) for _ in range(n))


def bad_payload(rng: random.Random) -> dict[str, Any]:
    return rng.choice([
        {"text": ""},
        {"text": "hi", "sampling_params": {"temperature": -1}},
        {"text": "hi", "sampling_params": {"max_new_tokens": 10**7}},
        {"text": "hi", "sampling_params": {"no_such_param": 1}},
        {"input_ids": [10**9]},
        {"text": "hi", "sampling_params": {"regex": "(unclosed"}},
    ])


def good_payload(rng: random.Random, max_new: int) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": rng.randint(1, max_new)}
    if rng.random() < 0.5:
        params["temperature"] = 0
    else:
        params.update(temperature=0.8, top_p=0.95)
    return {"text": prompt_text(rng), "sampling_params": params, "stream": rng.random() < 0.5}


# ---- HTTP clients -------------------------------------------------------------------------


async def http_client(url: str, stop_at: float, rng: random.Random, counts: Counts, args: argparse.Namespace) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0)) as client:
        while time.monotonic() < stop_at:
            if rng.random() < args.bad:
                try:
                    resp = await client.post("/generate", json=bad_payload(rng))
                    if 400 <= resp.status_code < 500:
                        counts.rejected += 1
                    else:
                        counts.bad_accepted += 1
                except httpx.HTTPError:
                    counts.transport_errors += 1
                continue
            payload = good_payload(rng, args.max_new_tokens)
            disconnect = rng.random() < args.disconnect
            t0 = time.monotonic()
            try:
                if payload["stream"]:
                    await _stream_once(client, payload, disconnect, rng, counts)
                else:
                    await _plain_once(client, payload, disconnect, rng, counts)
            except httpx.HTTPError:
                counts.transport_errors += 1
                continue
            counts.latencies.append(time.monotonic() - t0)


def _count_status(status: int, counts: Counts) -> bool:
    if status >= 500:
        counts.server_errors += 1
    elif status >= 400:
        counts.unexpected_4xx += 1
    return status == 200


async def _plain_once(client: Any, payload: dict[str, Any], disconnect: bool, rng: random.Random,
                      counts: Counts) -> None:
    request = client.post("/generate", json=payload)
    if disconnect:
        try:
            resp = await asyncio.wait_for(request, rng.uniform(0.05, 2.0))
        except asyncio.TimeoutError:  # the client gave up: the server must abort the request
            counts.disconnected += 1
            return
    else:
        resp = await request
    if _count_status(resp.status_code, counts):
        counts.served += 1
        counts.output_tokens += len(resp.json()["output_ids"])


async def _stream_once(client: Any, payload: dict[str, Any], disconnect: bool, rng: random.Random,
                       counts: Counts) -> None:
    leave_after = rng.randint(1, 6) if disconnect else None
    chunks = 0
    async with client.stream("POST", "/generate", json=payload) as resp:
        if not _count_status(resp.status_code, counts):
            await resp.aread()
            return
        last: dict[str, Any] | None = None
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            last = json.loads(line[5:])
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                counts.disconnected += 1  # leaving the block closes the connection mid-stream
                return
    if last is not None:
        counts.served += 1
        counts.output_tokens += len(last.get("output_ids", []))


# ---- in-process clients ---------------------------------------------------------------------


async def engine_client(engine: Any, stop_at: float, rng: random.Random, counts: Counts,
                        args: argparse.Namespace) -> None:
    import sgl

    while time.monotonic() < stop_at:
        if rng.random() < args.bad:
            bad = bad_payload(rng)
            try:
                await engine.generate(bad.get("text"), input_ids=bad.get("input_ids"),
                                      **bad.get("sampling_params", {}))
                counts.bad_accepted += 1
            except sgl.InvalidRequestError:
                counts.rejected += 1
            continue
        payload = good_payload(rng, args.max_new_tokens)
        t0 = time.monotonic()
        task = asyncio.ensure_future(engine.generate(payload["text"], **payload["sampling_params"]))
        try:
            if rng.random() < args.disconnect:
                await asyncio.sleep(rng.uniform(0.05, 2.0))
                if not task.done():
                    task.cancel()
                    counts.disconnected += 1
                    continue
            out = await task
            counts.served += 1
            counts.output_tokens += len(out.token_ids)
            counts.latencies.append(time.monotonic() - t0)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
        except sgl.SglError:
            counts.server_errors += 1


# ---- the run ----------------------------------------------------------------------------------


def rss_mb(pid: int) -> tuple[float, float]:
    """(current RSS, peak RSS) of a process in MiB, from /proc."""
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024
    return values.get("VmRSS", 0.0), values.get("VmHWM", 0.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "sgl", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-total-tokens", str(args.max_total_tokens), "--debug-integrity"]
    if args.model:
        cmd += ["--model", args.model]
    if args.max_running_requests:
        cmd += ["--max-running-requests", str(args.max_running_requests)]
    log = open(args.server_log, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


async def wait_ready(url: str, proc: subprocess.Popen | None, limit: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + limit
    async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}; see its log")
            try:
                if (await client.get("/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise SystemExit("the server did not become healthy in time")


async def sample_loop(get_stats: Any, pid: int, t0: float, samples: list[dict[str, Any]],
                      every: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            s = await get_stats()
            rss, _ = rss_mb(pid)
            samples.append(dict(t=round(time.monotonic() - t0, 1), kv_used=s["kv_used_tokens"],
                                kv_cached=s["kv_cached_tokens"], running=s["running"],
                                waiting=s["waiting"], rss_mb=round(rss, 1)))
        except Exception as exc:  # noqa: BLE001 - a missed sample is reported, not fatal
            samples.append(dict(t=round(time.monotonic() - t0, 1), error=repr(exc)))
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


async def drain(get_stats: Any, limit: float = 60.0) -> dict[str, Any]:
    """Wait for the engine to go idle after the clients stop; returns the final stats."""
    deadline = time.monotonic() + limit
    s = await get_stats()
    while time.monotonic() < deadline and (s["running"] or s["waiting"]):
        await asyncio.sleep(0.5)
        s = await get_stats()
    await asyncio.sleep(1.0)  # the idle integrity check runs on the engine thread
    return await get_stats()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    counts = Counts()
    samples: list[dict[str, Any]] = []
    proc = None
    engine = None
    if args.in_process:
        import sgl

        engine = sgl.Engine(args.model, max_total_tokens=args.max_total_tokens, debug_integrity=True,
                             **({"max_running_requests": args.max_running_requests}
                                if args.max_running_requests else {}))
        pid = os.getpid()

        async def get_stats() -> dict[str, Any]:
            return asdict(engine.stats())
    else:
        import httpx

        if args.url:
            url = args.url
            pid = args.server_pid or 0
        else:
            proc, url = start_server(args)
            pid = proc.pid
        await wait_ready(url, proc)
        stats_client = httpx.AsyncClient(base_url=url, timeout=30.0)

        async def get_stats() -> dict[str, Any]:
            return (await stats_client.get("/get_server_info")).json()["stats"]

    rss_start = rss_mb(pid)[0] if pid else 0.0
    t0 = time.monotonic()
    stop_at = t0 + args.duration
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_loop(get_stats, pid, t0, samples, args.sample_every, stop))
    rngs = [random.Random(args.seed * 1000 + i) for i in range(args.concurrency)]
    if engine is not None:
        clients = [engine_client(engine, stop_at, r, counts, args) for r in rngs]
    else:
        clients = [http_client(url, stop_at, r, counts, args) for r in rngs]
    await asyncio.gather(*clients)
    wall = time.monotonic() - t0
    final = await drain(get_stats)
    stop.set()
    await sampler
    rss_end, rss_peak = rss_mb(pid) if pid else (0.0, 0.0)
    alive = True
    if engine is not None:
        engine.check_integrity()
        engine.close()
    elif proc is not None:
        alive = proc.poll() is None
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if engine is None:
        await stats_client.aclose()
    lat = sorted(counts.latencies)
    kv_used = [s["kv_used"] for s in samples if "kv_used" in s]
    return dict(
        ts=time.strftime("%Y-%m-%dT%H:%M:%S"),
        commit=_git_commit(),
        mode="in-process" if args.in_process else "server",
        model=args.model or "default",
        duration_s=round(wall, 1),
        concurrency=args.concurrency,
        max_total_tokens=args.max_total_tokens,
        disconnect_share=args.disconnect,
        requests_served=counts.served,
        requests_disconnected=counts.disconnected,
        bad_requests_rejected=counts.rejected,
        bad_requests_accepted=counts.bad_accepted,
        unexpected_4xx=counts.unexpected_4xx,
        server_errors=counts.server_errors,
        transport_errors=counts.transport_errors,
        output_tokens=counts.output_tokens,
        output_tokens_per_s=round(counts.output_tokens / wall, 1),
        latency_p50_s=round(lat[len(lat) // 2], 3) if lat else None,
        latency_p99_s=round(lat[int(len(lat) * 0.99)], 3) if lat else None,
        kv_used_max=max(kv_used) if kv_used else None,
        kv_used_mean=round(sum(kv_used) / len(kv_used), 1) if kv_used else None,
        retractions=final["retractions"],
        final_running=final["running"],
        final_waiting=final["waiting"],
        final_kv_used=final["kv_used_tokens"],
        final_kv_cached=final["kv_cached_tokens"],
        leaked_kv_slots=final["kv_used_tokens"] - final["kv_cached_tokens"],
        server_alive_at_end=alive,
        rss_start_mb=round(rss_start, 1),
        rss_end_mb=round(rss_end, 1),
        rss_peak_mb=round(rss_peak, 1),
        samples=samples,
    )


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=16, help="clients, one request in flight each")
    p.add_argument("--disconnect", type=float, default=0.3, help="share of requests abandoned half-way")
    p.add_argument("--bad", type=float, default=0.05, help="share of deliberately bad requests")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-total-tokens", type=int, default=4096, help="KV pool (small: forces retraction)")
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--model", default=None, help="model for the server (default: the embedded one)")
    p.add_argument("--url", default=None, help="use this running server instead of starting one")
    p.add_argument("--server-pid", type=int, default=None, help="with --url: pid to read RSS from")
    p.add_argument("--server-log", default="/tmp/sgl-soak-server.log")
    p.add_argument("--in-process", action="store_true", help="drive sgl.Engine directly (no HTTP)")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between KV/RSS samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-save", action="store_true", help="do not append to bench/results/soak.jsonl")
    args = p.parse_args()
    result = asyncio.run(run(args))
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    print("KV used over time (t s: used/cached, running+waiting, RSS MiB):")
    for s in result["samples"]:
        if "kv_used" in s:
            print(f"  {s['t']:7.1f}: {s['kv_used']:6d}/{s['kv_cached']:<6d} {s['running']:3d}+{s['waiting']:<3d} "
                  f"{s['rss_mb']:8.1f}")
    if not args.no_save:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        with open(RESULTS, "a") as f:
            f.write(json.dumps(result) + "\n")
    ok = (result["server_errors"] == 0 and result["leaked_kv_slots"] == 0 and result["final_running"] == 0
          and result["bad_requests_accepted"] == 0 and result["server_alive_at_end"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
