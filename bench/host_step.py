"""Host time of one engine-loop step on the CPU: the loop iteration minus the C decode step
and the C LM head (issue 14's "per-token host overhead").

    python bench/host_step.py [--rows 1] [--new 128] [--reps 3] [--stream] [--overlap]

The engine thread's `Scheduler.schedule` is wrapped to timestamp each iteration, and the two
C entry points (`sgl_decode_step`, `sgl_qlinear`) to add up their time; an iteration's host
time is its wall time minus the C time inside it. Reported: the median over the steps where
all `--rows` requests decode (a robust figure on a shared machine), per rep, and the median of
the reps; beside it, the median time of one C decode step and of one C LM head call over all
reps, and the output tokens per second of the last rep. Prompts: 128 tokens each, greedy, EOS
ignored, the default model.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import sgl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--stream", action="store_true", help="stream the one request (rows 1)")
    ap.add_argument("--overlap", action="store_true", help="the overlap loop (off by default)")
    args = ap.parse_args()
    engine = sgl.Engine(disable_overlap_schedule=not args.overlap)
    from sgl.backend.quant import cpu_kernel

    lib = cpu_kernel._library()
    if lib is None:
        raise SystemExit("the CPU kernel library is unavailable: nothing to subtract")
    c_time = [0.0]
    calls: dict[str, list[float]] = {"sgl_decode_step": [], "sgl_qlinear": []}
    for name in calls:
        fn = getattr(lib, name)

        def timed(*a: object, _fn: object = fn, _name: str = name) -> object:
            t = time.perf_counter()
            try:
                return _fn(*a)  # type: ignore[operator]
            finally:
                c_time[0] += time.perf_counter() - t
                calls[_name].append(time.perf_counter() - t)

        setattr(lib, name, timed)
    sched = engine._rt.core.scheduler
    marks: list[tuple[float, float, int]] = []
    schedule = sched.schedule

    def marked() -> object:
        marks.append((time.perf_counter(), c_time[0], len(sched.running)))
        return schedule()

    sched.schedule = marked  # type: ignore[method-assign]
    text = "The quick brown fox jumps over the lazy dog. " * 40
    prompts = [engine.encode(f"{i} " + text)[:128] for i in range(args.rows)]
    kw = dict(max_new_tokens=args.new, temperature=0, ignore_eos=True)

    async def run() -> list[float]:
        if args.stream:
            async for _ in await engine.generate(input_ids=prompts[0], stream=True, **kw):
                pass
        else:
            await engine.generate(input_ids=prompts if args.rows > 1 else prompts[0], **kw)
        steps = [(b[0] - a[0]) - (b[1] - a[1]) for a, b in zip(marks[2:], marks[3:])
                 if a[2] == b[2] == args.rows]
        marks.clear()
        return steps

    async def reps() -> None:
        await run()  # warm-up
        for times in calls.values():
            times.clear()
        medians = []
        for _ in range(args.reps):
            start = time.perf_counter()
            medians.append(statistics.median(await run()) * 1e3)
            tok_s = args.rows * args.new / (time.perf_counter() - start)
        step, head = (statistics.median(calls[n]) * 1e3 if calls[n] else float("nan")
                      for n in ("sgl_decode_step", "sgl_qlinear"))
        print(f"rows={args.rows} stream={args.stream} overlap={args.overlap}: host per step "
              f"{statistics.median(medians):.3f} ms (reps: {' '.join(f'{m:.3f}' for m in medians)})"
              f"; C step {step:.2f} ms, C head {head:.2f} ms; last rep {tok_s:.1f} tok/s")

    asyncio.run(reps())
    engine.close()


if __name__ == "__main__":
    main()
