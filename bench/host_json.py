"""The engine loop's host cost per step on the JSON workload at GPU batch sizes, on the CPU.

    python bench/host_json.py [--requests 256] [--rounds 3] [--plain-loop] [--rerecord]

On the H200 the real default model's 256-row step is bound by the host's Python (issue 13:
free 16.5 ms a step, jump-forward off 23.6, on 30.7), so jump-forward's saved steps barely
show. This bench runs that host work on the CPU without the model: the engine is the real
one (tokenizer, grammars, scheduler, runner, overlap loop, mask-fill thread), with the GPU's
batch settings (256 running requests, 8192-token prefill chunks, 512 token rows per step), but
the runner's device half is a *replay*: each sampled row gets the token the real model sampled
there.

1. Record (once, cached in ~/.cache/sgl/bench/): bench/json_workload.py's extraction prompts,
   greedy, jump-forward on, on the real default model (CPU; its kernels are row-independent,
   so the tokens do not depend on the batch). Every sampled token is kept by output index.
2. Replay, rounds interleaved: `jump off`, `jump on` (the same prompts and schemas), and
   `free` (no constraint, EOS ignored, each prompt's recorded output length: the same rows,
   step for step). Jump-forward changes only the speed, so both constrained runs sample at the
   recorded output indices; an output that differs from the recording fails the bench.

Figures per run (medians over rounds): wall ms, the loop's span (first schedule to last
update; the rest of the wall is the caller preparing requests and parsing outputs), engine
steps, and the engine thread's CPU time per step by phase (time.thread_time around
`schedule`, `runner.prepare`, `scheduler.update`; `other` = the rest of the loop's thread
time: inbox, resume, start, the mask fill's Python part), plus the mask fill's CPU time per
step (xgrammar, on the fill thread). The replayed "device" costs nothing, so a step's period
is host work, as on the H200 with a 135M model: `jump on / off` in wall time is what the H200
would see, and host ms per step is what to cut. `--profile MODE` cProfiles the engine thread
over one run instead.
Appends one JSON line per call to bench/results/host_json.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record, table  # noqa: E402
from json_workload import workload  # noqa: E402

import torch  # noqa: E402

import sgl  # noqa: E402
from sgl.backend.step_io import StepResult  # noqa: E402

CACHE = Path.home() / ".cache" / "sgl" / "bench"
PHASES = ("schedule", "prepare", "update", "other", "fill")
MODEL = "SmolLM2-135M-Instruct (Q4_1 GGUF), replayed"


def record_tokens(n: int, path: Path) -> list[dict[str, Any]]:
    """The real model's greedy samples for the first `n` workload prompts; saved to `path`."""
    requests = workload(n)
    engine = sgl.Engine()
    samples: dict[tuple[int, ...], dict[int, int]] = {}
    scheduler = engine._rt.scheduler  # noqa: SLF001
    orig_append = scheduler._append  # noqa: SLF001

    def append(r, tok, lp, top):  # noqa: ANN001, ANN202
        samples.setdefault(tuple(r.prompt_ids), {})[len(r.output_ids)] = tok
        return orig_append(r, tok, lp, top)

    scheduler._append = append  # noqa: SLF001
    prompts = [engine.apply_chat_template(p, tokenize=True) for _, p in requests]
    t = time.perf_counter()

    async def go() -> list[Any]:
        return await asyncio.gather(*(
            engine.generate(input_ids=ids, schema=m, max_new_tokens=200, temperature=0)
            for ids, (m, _) in zip(prompts, requests)))

    try:
        outs = asyncio.run(go())
    finally:
        engine.close()
    print(f"recorded {n} requests in {time.perf_counter() - t:.0f} s", flush=True)
    data = [{"prompt": ids, "output": o.token_ids, "samples": samples[tuple(ids)]}
            for ids, o in zip(prompts, outs)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return data


def load_recording(n: int, rerecord: bool) -> list[dict[str, Any]]:
    path = CACHE / f"host_json_{n}.json"
    if rerecord or not path.exists():
        return record_tokens(n, path)
    data = json.loads(path.read_text())
    for d in data:
        d["samples"] = {int(k): v for k, v in d["samples"].items()}
    return data


class Replay:
    """Stands in for the runner's device half (`ModelRunner._execute`): waits for the step's
    grammar masks like the sampler would, then returns the recorded tokens of its rows."""

    def __init__(self, data: list[dict[str, Any]]) -> None:
        # prompt -> token at each output index (samples override the final output's tokens:
        # a jump may have rolled a sample back)
        self.tokens: dict[tuple[int, ...], dict[int, int]] = {}
        for d in data:
            self.tokens[tuple(d["prompt"])] = {**dict(enumerate(d["output"])), **d["samples"]}
        self.by_req: dict[Any, dict[int, int]] = {}  # Req -> its table (cleared per run)

    def __call__(self, step: Any) -> StepResult:
        if step.vocab_mask is not None:
            step.vocab_mask.result()
        tokens = []
        for it in step.batch.items:
            if it.samples:
                table = self.by_req.get(it.req)
                if table is None:
                    table = self.by_req[it.req] = self.tokens[tuple(it.req.prompt_ids)]
                tokens.append(table.get(it.output_index, 0))  # (0: a dropped sample's index)
        result = StepResult()
        if tokens:
            result.tokens = torch.tensor(tokens, dtype=torch.int64)
        return result


class PhaseClock:
    """The engine thread's CPU time per phase, and the fill thread's, summed over a run, and
    the wall times of the run's first and last timed call."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.replay: Replay | None = None
        self.first = self.last = 0.0

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.thread_time()
            self.first = self.first or time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[phase] += time.thread_time() - t
                self.last = time.perf_counter()

        return timed

    def reset(self) -> None:
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.first = self.last = 0.0  # perf_counter of the run's first and last timed call
        self.replay.by_req.clear()


def install(engine: sgl.Engine, data: list[dict[str, Any]]) -> PhaseClock:
    rt = engine._rt  # noqa: SLF001 - a benchmark may look inside
    clock = PhaseClock()
    runner, scheduler = rt.runner, rt.scheduler
    runner._execute = clock.replay = Replay(data)  # noqa: SLF001
    # Instance attributes shadow the methods the loop calls (self.scheduler.schedule() ...).
    scheduler.schedule = clock.wrap("schedule", scheduler.schedule)
    scheduler.update = clock.wrap("update", scheduler.update)
    runner.prepare = clock.wrap("prepare", runner.prepare)
    grammar = rt.grammar
    # (on the fill thread; a step with fewer than 8 constrained rows fills inside prepare)
    grammar._fill_rows = clock.wrap("fill", grammar._fill_rows)  # noqa: SLF001
    return clock


def engine_thread_time(engine: sgl.Engine) -> float:
    """CPU seconds the engine thread has used so far (its own POSIX clock)."""
    thread = engine._rt.core._thread  # noqa: SLF001
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def run(engine: sgl.Engine, clock: PhaseClock, data: list[dict[str, Any]], requests: list[Any],
        mode: str) -> dict[str, Any]:
    engine.flush_cache()
    clock.reset()
    steps0, cpu0 = engine.stats().steps, engine_thread_time(engine)
    if mode == "free":
        calls = [engine.generate(input_ids=d["prompt"], max_new_tokens=len(d["output"]), temperature=0,
                                 ignore_eos=True) for d in data]
    else:
        calls = [engine.generate(input_ids=d["prompt"], schema=m, max_new_tokens=200, temperature=0,
                                 jump_forward=mode == "jump on") for d, (m, _) in zip(data, requests)]

    async def go() -> list[Any]:
        return await asyncio.gather(*calls)

    t = time.perf_counter()
    outs = asyncio.run(go())
    wall = time.perf_counter() - t
    steps = engine.stats().steps - steps0
    loop_cpu = engine_thread_time(engine) - cpu0
    if mode != "free":
        wrong = sum(o.token_ids != d["output"] for o, d in zip(outs, data))
        if wrong:
            raise SystemExit(f"{mode}: {wrong} outputs differ from the recording")
    per_step = {k: 1e3 * v / steps for k, v in clock.totals.items()}
    per_step["other"] = 1e3 * loop_cpu / steps - sum(per_step[k] for k in ("schedule", "prepare", "update"))
    # the loop's span: first schedule to last update (the rest of the wall is the caller's:
    # preparing the 256 requests, then receiving and parsing the outputs)
    return {"wall_ms": 1e3 * wall, "loop_ms": 1e3 * (clock.last - clock.first), "steps": steps, **per_step}


def profile(engine: sgl.Engine, clock: PhaseClock, data: list[dict[str, Any]], requests: list[Any],
            mode: str) -> None:
    import cProfile
    import pstats

    run(engine, clock, data, requests, mode)  # warm
    prof = cProfile.Profile()
    core = engine._rt.core  # noqa: SLF001
    core.call(prof.enable)  # (on the engine thread: cProfile follows one thread)
    res = run(engine, clock, data, requests, mode)
    core.call(prof.disable)
    print(f"{mode}: {res['steps']} steps")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--plain-loop", action="store_true", help="the plain loop (default: overlap, as on CUDA)")
    ap.add_argument("--rerecord", action="store_true", help="record the real model's tokens again")
    ap.add_argument("--no-record", action="store_true", help="do not append to bench/results")
    ap.add_argument("--profile", choices=["jump off", "jump on", "free"],
                    help="instead: cProfile the engine thread over one run of this mode")
    args = ap.parse_args()
    data = load_recording(args.requests, args.rerecord)
    requests = workload(args.requests)
    engine = sgl.Engine(disable_overlap_schedule=args.plain_loop, max_running_requests=args.requests,
                        chunked_prefill_size=8192)
    results: dict[str, list[dict[str, Any]]] = {"jump off": [], "jump on": [], "free": []}
    try:
        from dataclasses import replace

        sched = engine._rt.scheduler  # noqa: SLF001
        sched.cfg = replace(sched.cfg, max_step_rows=2 * args.requests)  # the GPU's graph cap
        clock = install(engine, data)
        run(engine, clock, data[:8], requests[:8], "jump on")  # warm-up: compile the grammars
        if args.profile:
            profile(engine, clock, data, requests, args.profile)
            return
        for _ in range(args.rounds):
            for mode in results:
                results[mode].append(run(engine, clock, data, requests, mode))
    finally:
        engine.close()
    cols = ["wall_ms", "loop_ms", "steps", *PHASES]
    rows = [{"run": mode, **{c: statistics.median(r[c] for r in rs) for c in cols}}
            for mode, rs in results.items()]
    for row in rows:
        row["host ms/step"] = sum(row[p] for p in ("schedule", "prepare", "update", "other"))
        row["wall ms/step"] = row["wall_ms"] / row["steps"]
    print(table(rows, ["run", "wall_ms", "loop_ms", "steps", "wall ms/step", "host ms/step", *PHASES]))
    off, on, free = rows
    print(f"jump on / off: wall x{off['wall_ms'] / on['wall_ms']:.2f}, loop x{off['loop_ms'] / on['loop_ms']:.2f}, "
          f"engine thread CPU x{off['host ms/step'] * off['steps'] / (on['host ms/step'] * on['steps']):.2f}; host ms per step "
          f"on {on['host ms/step']:.2f} / off {off['host ms/step']:.2f} / free {free['host ms/step']:.2f}")
    print("json:", json.dumps(rows))  # (for scripts that compare builds)
    if not args.no_record:
        record("host_json", MODEL, f"json replay: {args.requests} prompts, "
               f"{'plain' if args.plain_loop else 'overlap'} loop, {args.rounds} rounds",
               {r["run"]: {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items() if k != "run"}
                for r in rows})


if __name__ == "__main__":
    main()
