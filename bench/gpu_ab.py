"""A before/after inside one engine: the 8B shape's single stream (or `fixed`), the variants
taking turns, the decode graphs recaptured at each turn.

    python bench/gpu_ab.py --engine q4 --variants q4_s22,q4 [--rounds 2] [--runs 3]
                           [--workload single|fixed] [--scale 0.25]

Why: two engines of the same variant built one after the other in one process have read 366
and 389 tok/s (session 23, `gpu_bench.py --quant-engines q4_s22,q4,...,q4_s22,q4`), while the
runs of one engine agree within ~1%. A change worth 1-3% cannot be seen across engines. Here
the weights, KV pool and everything else stay where they are; only the code the graphs
capture changes: every variant is an `engine_variant` of bench/gpu_bench.py whose switches are
read at capture (decode attention's merge, the GEMVs' tables and early launches), not at load
(`fp8_s9`'s FP8 head, `q4km`'s layout: those need their own engine). Each turn recaptures
the graphs under the variant, warms up, then takes the median of `--runs` runs of the
workload: `single` (`gpu_bench.w_single`: one request, 128 prompt tokens, 512 new) or
`fixed` (`gpu_bench.w_fixed`: 512 x `--scale` requests of 1,024 prompt tokens and 256 new,
as gpu_bench's quant section runs it; its prefill runs eagerly, under the variant too: the
runs happen inside `engine_variant`). Prints one line per turn and, per
variant, the median of its turns; appends the rows to $OUT/gpu_bench.jsonl when $OUT is set.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench as gb  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="q4",
                    help=f"one of {sorted(gb.QUANT_ENGINES)}: its options")
    ap.add_argument("--variants", default="q4_s22,q4",
                    help="engine_variant names, in turn order (their switches read at capture)")
    ap.add_argument("--rounds", type=int, default=2, help="times each variant takes its turn")
    ap.add_argument("--runs", type=int, default=3, help="runs of the workload per turn (median)")
    ap.add_argument("--workload", choices=("single", "fixed"), default="single")
    ap.add_argument("--scale", type=float, default=0.25, help="fixed: 512 x this requests")
    ap.add_argument("--budget", type=float, default=400.0, help="seconds; later turns skip")
    args = ap.parse_args()
    gb.DEADLINE[0] = time.monotonic() + args.budget
    vocab = 128256  # the Llama-3.1-8B shape's
    e = gb.make_engine("llama3-8b", **gb.QUANT_ENGINES[args.engine])
    graphs = e._rt.runner.graphs
    assert graphs is not None, "the decode graphs are off: nothing to recapture"
    reqs = (gb.w_single(vocab) if args.workload == "single"
            else gb.w_fixed(max(8, int(512 * args.scale)), vocab))
    turns: dict[str, list[float]] = {}
    try:
        for turn in range(args.rounds):
            for name in args.variants.split(","):
                if gb.left() < 30:
                    gb.note(f"ab: {name} turn {turn} skipped: out of time")
                    continue
                with gb.engine_variant(name):
                    graphs.capture()
                    gb.warmup(e, vocab)
                    runs = sorted(gb.run(e, reqs)["output_tok_s"]
                                  for _ in range(max(1, args.runs)))
                median = runs[len(runs) // 2]
                turns.setdefault(name, []).append(median)
                gb.note(f"ab {args.engine} turn {turn} {name}: {median:.1f} tok/s "
                        f"(runs {', '.join(f'{r:.1f}' for r in runs)})")
                gb.record("llama3-8b", f"ab {args.workload} ({name}, turn {turn})",
                          {"output_tok_s": median, "runs_tok_s": runs, "engine": args.engine})
    finally:
        gb.close_engine(e)
    base = None
    for name, values in turns.items():
        value = statistics.median(values)
        base = value if base is None else base
        gb.note(f"ab {args.engine} {name}: median of {len(values)} turns {value:.1f} tok/s, "
                f"{value / base:.3f}x the first variant")
    return 0


if __name__ == "__main__":
    sys.exit(main())
