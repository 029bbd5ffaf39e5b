"""BENCH.md's `json` workload: constrained decoding and jump-forward on the default model (CPU).

    python bench/json_workload.py [--requests 64] [--concurrency 64] [--rounds 2] [--device cpu]

`--device cuda` runs the same real-weights workload on the GPU at the engine's defaults (overlap
on, so the per-part step timings below are not taken: wall time, steps and passes only), e.g.
`--device cuda --requests 256 --concurrency 256`: where jump-forward's saved steps show at GPU
batch sizes with a model whose outputs end (random weights write long strings instead).

64 short extraction prompts over 3 Pydantic schemas (tests/extraction_schemas.py; fixed seed),
generated greedily until the grammar ends (JSON indented by 2 spaces, the engine's default
layout). Four runs on one engine, the radix cache flushed before each so every run prefills the
same prompts:

1. `jump off`: masked decoding only.
2. `jump on`: masked decoding + jump-forward (the default).
3. `free`: no constraint, the same prompts, each with exactly as many new tokens (EOS ignored)
   as it produced in run 1: the same batches step for step, so the step times compare.
4. (no extra run) agreement of the parsed fields of 1 vs 2.

Figures:
- output tokens/s (tokens in the final outputs / wall time) and model forward passes: engine
  steps (batched forward passes) and, per request, the steps that sampled a token for it
  (`Scheduler._append` calls: one per forward pass the request took part in);
- mask cost per decode step: `GrammarBackend.fill_bitmasks` and the sampler's
  `apply_token_bitmask`, timed inside the engine on the real batches of run 1, against the
  decode step time of run 3. Also the whole constrained decode step against the free one
  (that difference adds the matchers' `accept_token` and the bookkeeping around them).

The engine runs with the overlap loop off: constrained steps run synchronously anyway (a mask
needs the previous token accepted), so this makes the free baseline step comparable.
Appends one JSON line per run to bench/results/json_workload.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))  # the schemas the tests share
from common import record, table  # noqa: E402
from extraction_schemas import Meeting, Person, Product  # noqa: E402

import sgl  # noqa: E402

MODEL = "SmolLM2-135M-Instruct (Q4_1 GGUF)"


# -- the workload -------------------------------------------------------------------------------


FIRST = ["John", "Maria", "Li", "Tom", "Aisha", "Pedro", "Yuki", "Olga", "Sam", "Fatima", "Erik", "Nina"]
LAST = ["Smith", "Garcia", "Wei", "Baker", "Khan", "Silva", "Tanaka", "Ivanova", "Lee", "Haddad"]
CITIES = ["Boston", "Madrid", "Shanghai", "Chicago", "Lagos", "Lima", "Osaka", "Kyiv", "Denver", "Cairo"]
ITEMS = ["Acme Kettle", "Zen Headphones", "Blue Mug", "Nova Lamp", "Trail Backpack", "Aero Fan",
         "Pixel Frame", "Cedar Desk"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def _person(rng: random.Random) -> str:
    name, age, city = f"{rng.choice(FIRST)} {rng.choice(LAST)}", rng.randint(18, 90), rng.choice(CITIES)
    return rng.choice([f"{name} is {age} years old and lives in {city}.",
                       f"{name}, aged {age}, moved to {city} last year.",
                       f"Meet {name} ({age}), a teacher from {city}."])


def _product(rng: random.Random) -> str:
    item, price = rng.choice(ITEMS), rng.choice([8, 19.99, 24.5, 45, 120, 199.99])
    stock = rng.choice(["is in stock", "is sold out", "ships today", "is out of stock"])
    return f"The {item} costs ${price} and {stock}."


def _meeting(rng: random.Random) -> str:
    person, day, hour = rng.choice(FIRST), rng.choice(DAYS), rng.randint(8, 18)
    return rng.choice([f"Let's meet {person} on {day} at {hour}:00.",
                       f"Call with {person} on {day}, {hour}:00 sharp."])


SCHEMAS: list[tuple[type[BaseModel], Callable[[random.Random], str]]] = [
    (Person, _person), (Product, _product), (Meeting, _meeting)]


def workload(n: int, seed: int = 0) -> list[tuple[type[BaseModel], list[dict[str, str]]]]:
    """n extraction requests, cycling over the 3 schemas."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        model, make = SCHEMAS[i % len(SCHEMAS)]
        fields = ", ".join(model.model_fields)
        out.append((model, [{"role": "user",
                             "content": f"Extract {fields} from the text as JSON.\n\nText: {make(rng)}"}]))
    return out


# -- instrumentation (bench only: wraps engine internals on the instance) ---------------------


@dataclass
class Probe:
    """Per-step timings and per-request pass counts, recorded on the engine thread."""

    decode_steps: list[float] = field(default_factory=list)  # launch + process, seconds
    decode_rows: list[int] = field(default_factory=list)
    fill: list[float] = field(default_factory=list)  # fill_bitmasks per decode step
    apply: list[float] = field(default_factory=list)  # apply_token_bitmask per decode step
    prepare: list[float] = field(default_factory=list)  # runner.prepare (includes fill)
    execute: list[float] = field(default_factory=list)  # runner._execute (forward + sample)
    process: list[float] = field(default_factory=list)  # scheduler.update (accept, stop checks)
    passes: dict[tuple[str, int], int] = field(default_factory=dict)  # request -> sampled steps
    # every step's kind and token rows: "graph" (a decode graph replayed: decode rows, jumped
    # tokens), "eager decode" (past the prompts but too many rows for the largest graph),
    # "prefill"
    kinds: list[tuple[str, int]] = field(default_factory=list)
    now: dict[str, float] = field(default_factory=dict)  # the step being timed

    def reset(self) -> None:
        for xs in (self.decode_steps, self.decode_rows, self.fill, self.apply, self.prepare,
                   self.execute, self.process):
            xs.clear()
        self.passes.clear()
        self.kinds.clear()

    def timed(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[phase] = self.now.get(phase, 0.0) + time.perf_counter() - t

        return wrapper


def install_probe(engine: sgl.Engine, timing: bool = True) -> Probe:
    """Counts each request's sampled steps; with `timing`, also times every decode step's parts
    (which makes the loop synchronous: no overlap)."""
    rt = engine._rt  # noqa: SLF001 - a benchmark may look inside
    probe = Probe()
    scheduler = rt.scheduler
    orig_append = scheduler._append  # noqa: SLF001

    def append(r, tok, lp, top):  # noqa: ANN001, ANN202
        key = (r.rid, r.sample_index)
        probe.passes[key] = probe.passes.get(key, 0) + 1
        return orig_append(r, tok, lp, top)

    scheduler._append = append  # noqa: SLF001
    runner = rt.runner
    plain_prepare = runner.prepare

    def classify(batch, *args):  # noqa: ANN001, ANN002, ANN202
        step = plain_prepare(batch, *args)
        plan = getattr(step, "plan", None)
        if plan is not None:
            past = batch.is_decode or all(it.prefix_len >= len(it.req.prompt_ids) for it in batch.items)
            kind = "graph" if step.graph_bs is not None else "eager decode" if past else "prefill"
            probe.kinds.append((kind, plan.num_tokens))
        return step

    runner.prepare = classify
    if not timing:
        return probe
    grammar = rt.grammar  # builds the backend now, so the wrapper sees every call
    # Instance attributes shadow the methods: the engine calls self.runner.prepare(...) etc.
    grammar.fill_bitmasks = probe.timed("fill", grammar.fill_bitmasks)
    sampler = rt.sampler  # the kernel set's mask op, held by the sampler
    sampler.apply_token_bitmask = probe.timed("apply", sampler.apply_token_bitmask)
    runner._execute = probe.timed("execute", runner._execute)  # noqa: SLF001
    timed_prepare, orig_start, orig_update = (probe.timed("prepare", runner.prepare), runner.start,
                                              scheduler.update)
    launched: list[tuple[float, Any]] = []

    def prepare(batch, *args):  # noqa: ANN001, ANN002, ANN202
        probe.now.clear()
        t = time.perf_counter()
        step = timed_prepare(batch, *args)
        launched.append((t, batch))
        return step

    def start(step):  # noqa: ANN001, ANN202
        handle = orig_start(step)
        handle.result()  # the loop is synchronous here (overlap off): wait inside the step
        return handle

    def update(batch, out):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        orig_update(batch, out)
        t1 = time.perf_counter()
        t, batch_launched = launched.pop()
        if batch_launched.is_decode:
            probe.decode_steps.append(t1 - t)
            probe.decode_rows.append(len(batch_launched.items))
            probe.process.append(t1 - t0)
            for phase in ("fill", "apply", "prepare", "execute"):
                getattr(probe, phase).append(probe.now.get(phase, 0.0))

    runner.prepare, runner.start = prepare, start
    scheduler.update = update
    return probe


# -- runs ---------------------------------------------------------------------------------------

PHASES = ("step", "prepare", "fill", "execute", "apply", "process")


@dataclass
class RunResult:
    name: str
    wall: float
    steps: int
    outputs: list[sgl.GenerateOutput]
    passes: list[int]
    rows: float  # mean sampled rows per decode step
    ms: dict[str, float]  # mean milliseconds per decode step, by phase (see PHASES)
    kinds: dict[str, tuple[int, float]] = field(default_factory=dict)  # kind -> (steps, mean rows)

    @property
    def output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall


async def _run_waves(calls: list[Callable[[], Any]], concurrency: int) -> list[Any]:
    results: list[Any] = []
    for start in range(0, len(calls), concurrency):
        results += await asyncio.gather(*(call() for call in calls[start:start + concurrency]))
    return results


def run(engine: sgl.Engine, probe: Probe, name: str, requests, concurrency: int,
        jump: bool | None, free_tokens: list[int] | None = None) -> RunResult:
    engine.flush_cache()
    probe.reset()
    if free_tokens is None:
        calls = [lambda m=m, p=p: engine.generate(p, schema=m, max_new_tokens=200, temperature=0,
                                                  jump_forward=jump) for m, p in requests]
    else:
        calls = [lambda p=p, n=n: engine.generate(p, max_new_tokens=n, temperature=0, ignore_eos=True)
                 for (_, p), n in zip(requests, free_tokens)]
    steps0 = engine.stats().steps
    t = time.perf_counter()
    outputs = asyncio.run(_run_waves(calls, concurrency))
    wall = time.perf_counter() - t
    passes = [probe.passes.get((o.request_id, o.index), 0) for o in outputs]
    series = {"step": probe.decode_steps, "prepare": probe.prepare, "fill": probe.fill,
              "execute": probe.execute, "apply": probe.apply, "process": probe.process}
    ms = {k: 1e3 * statistics.fmean(v) if v else 0.0 for k, v in series.items()}
    rows = statistics.fmean(probe.decode_rows) if probe.decode_rows else 0.0
    rows_by_kind: dict[str, list[int]] = {}
    for kind, n in probe.kinds:
        rows_by_kind.setdefault(kind, []).append(n)
    kinds = {k: (len(v), statistics.fmean(v)) for k, v in rows_by_kind.items()}
    return RunResult(name, wall, engine.stats().steps - steps0, outputs, passes, rows, ms, kinds)


def median_run(runs: list[RunResult]) -> RunResult:
    """Counts from the first run (greedy: identical every round), times as medians."""
    first = runs[0]
    return RunResult(first.name, statistics.median(r.wall for r in runs), first.steps, first.outputs,
                     first.passes, first.rows,
                     {k: statistics.median(r.ms[k] for r in runs) for k in PHASES}, first.kinds)


def agreement(a: list[sgl.GenerateOutput], b: list[sgl.GenerateOutput]) -> tuple[int, int]:
    same = total = 0
    for x, y in zip(a, b):
        fx, fy = x.parsed.model_dump(), y.parsed.model_dump()
        total += len(fx)
        same += sum(fx[k] == fy.get(k) for k in fx)
    return same, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds of (off, on, free), interleaved so load drift hits all three; "
                         "times are medians over rounds")
    ap.add_argument("--device", default="cpu",
                    help="cpu (overlap off, every decode step timed by part) or cuda (the "
                         "engine's defaults, overlap on: wall time, steps and passes only)")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()

    requests = workload(args.requests)
    on_cpu = args.device == "cpu"
    engine = (sgl.Engine(disable_overlap_schedule=True) if on_cpu
              else sgl.Engine(device=args.device))
    results: dict[str, list[RunResult]] = {"jump off": [], "jump on": [], "free": []}
    try:
        probe = install_probe(engine, timing=on_cpu)
        sizes = engine._rt.cuda_graph_sizes  # noqa: SLF001
        print(f"decode graphs: {len(sizes)}, up to {sizes[-1] if sizes else 0} token rows; "
              f"max running requests {engine._rt.scheduler.cfg.max_running_requests}")  # noqa: SLF001
        # Warm-up: compile the 3 grammars, touch every code path once.
        asyncio.run(_run_waves([lambda m=m, p=p: engine.generate(p, schema=m, max_new_tokens=60, temperature=0)
                                for m, p in requests[:3]], 3))
        lengths: list[int] | None = None
        for _ in range(args.rounds):
            results["jump off"].append(run(engine, probe, "jump off", requests, args.concurrency, False))
            lengths = lengths or [len(o.token_ids) for o in results["jump off"][0].outputs]
            results["jump on"].append(run(engine, probe, "jump on", requests, args.concurrency, True))
            results["free"].append(run(engine, probe, "free", requests, args.concurrency, None, lengths))
    finally:
        engine.close()
    off, on, free = (median_run(results[k]) for k in ("jump off", "jump on", "free"))

    rows = [{"run": r.name, "wall s": r.wall, "out tokens": r.output_tokens, "out tok/s": r.tok_s,
             "engine steps": r.steps, "passes/req": statistics.fmean(r.passes), "rows/step": r.rows,
             **{f"{k} ms": r.ms[k] for k in PHASES}} for r in (off, on, free)]
    print(table(rows, list(rows[0])))
    print("(per decode step: step = prepare + execute + process; fill is inside prepare, apply "
          "inside execute)")

    saved_passes = 1 - sum(on.passes) / sum(off.passes)
    saved_steps = 1 - on.steps / off.steps
    mask_ms = off.ms["fill"] + off.ms["apply"]
    mask_share = mask_ms / free.ms["step"] if on_cpu else 0.0
    step_overhead = off.ms["step"] / free.ms["step"] - 1 if on_cpu else 0.0
    same, total = agreement(on.outputs, off.outputs)
    same_text = sum(a.text == b.text for a, b in zip(on.outputs, off.outputs))
    print(f"\njump-forward saves {saved_passes:.1%} of per-request forward passes "
          f"({sum(off.passes)} -> {sum(on.passes)}) and {saved_steps:.1%} of engine steps "
          f"({off.steps} -> {on.steps}); target >= 30%")
    print(f"output tokens/s: {on.tok_s:.1f} jump on vs {off.tok_s:.1f} off (x{on.tok_s / off.tok_s:.2f}); "
          f"free decoding of the same token counts {free.tok_s:.1f}")
    if on_cpu:
        print(f"mask fill + apply: {mask_ms:.2f} ms per decode step = {mask_share:.1%} of the free "
              f"decode step ({free.ms['step']:.1f} ms at {free.rows:.0f} rows); target <= 10%")
        print(f"whole constrained decode step vs free: {off.ms['step']:.1f} vs {free.ms['step']:.1f} "
              f"ms ({step_overhead:+.1%}); process {off.ms['process']:.1f} vs "
              f"{free.ms['process']:.1f} ms")
    for r in (off, on, free):
        print(f"{r.name} steps by kind (steps, mean token rows): "
              + ", ".join(f"{k} {n} ({rows:.0f})" for k, (n, rows) in sorted(r.kinds.items())))
    print(f"fields agreeing jump on vs off: {same}/{total} ({same / total:.1%}); "
          f"identical texts {same_text}/{len(on.outputs)}")

    figures = {
        "device": args.device, "requests": args.requests, "concurrency": args.concurrency,
        "rounds": args.rounds,
        "out_tok_s_jump_on": round(on.tok_s, 2), "out_tok_s_jump_off": round(off.tok_s, 2),
        "out_tok_s_free_same_tokens": round(free.tok_s, 2),
        "engine_steps_on": on.steps, "engine_steps_off": off.steps,
        "passes_per_req_on": round(statistics.fmean(on.passes), 2),
        "passes_per_req_off": round(statistics.fmean(off.passes), 2),
        "forward_passes_saved": round(saved_passes, 4), "engine_steps_saved": round(saved_steps, 4),
        "decode_step_ms": {r.name: {k: round(v, 3) for k, v in r.ms.items()} for r in (off, on, free)},
        "mask_ms_per_decode_step": round(mask_ms, 3),
        "mask_share_of_free_decode_step": round(mask_share, 4),
        "constrained_step_overhead": round(step_overhead, 4),
        "field_agreement": round(same / total, 4), "identical_texts": same_text,
        "step_kinds": {r.name: r.kinds for r in (off, on, free)},
    }
    if not args.no_record:
        record("json_workload", MODEL, f"json: {args.requests} extraction prompts, 3 schemas, "
               f"indent 2, concurrency {args.concurrency}", figures)


if __name__ == "__main__":
    main()
