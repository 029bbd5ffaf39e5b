"""Program throughput of the sgl language on the default model: radix cache and KV reuse.

    python bench/lang_programs.py [--questions 64] [--fork-programs 16] [--fork-width 4]

Two workloads, each run under configurations of:

    few_shot_qa   run_batch over N questions; a ~300-token prompt of worked examples shared by
                  all programs, then two gens per program (an answer, then a follow-up that
                  continues the same state, so the second gen's prompt holds the first's output)
    fork          P programs, each with its own context, fork(W) branches generating one idea
                  each, a gather join, then a summary gen over the branches

    radix cache   on (default) or off (sgl.Engine(disable_radix_cache=True))
    execution     tokens: sgl's EngineBackend, each gen sends the state's token ids, generated
                  tokens included as the model produced them (KV-reusing execution)
                  text: the same programs through TextResendBackend below, which sends the
                  state's text each gen and lets the engine re-tokenize it (how SGLang's
                  frontend talks to its runtime)

By default three configurations: on:tokens, on:text, off:tokens (`--configs` picks any).
Prints a table (programs/s, output tok/s, prompt tokens, cache hit rate, and "noncanon": how
many programs ended with a token sequence that differs from tokenizing their text, i.e. where
resending text loses the model's own tokens) and appends one JSON
line per run to bench/results/lang_programs.jsonl. Figures come from `engine.stats()` deltas
over each run: cache hit rate = cached prompt tokens / prompt tokens of the run's requests.
Each run starts from a flushed cache after one warm-up program. On a shared machine, use
`--repeat 2` (the order of the execution modes alternates between repeats) and compare runs
made close together.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import sgl  # noqa: E402
from sgl.lang import EngineBackend, Prompt  # noqa: E402

Execution = Literal["tokens", "text"]
RESULTS = ROOT / "bench" / "results" / "lang_programs.jsonl"


class TextResendBackend(EngineBackend):
    """Baseline: every gen sends the state's text, and the engine re-tokenizes it.

    The interpreter still tracks tokens (it is the same interpreter); only what reaches the
    engine changes. The radix cache then matches the re-tokenized text, which differs from
    the KV the engine holds wherever the model produced a non-canonical split, and the
    whole prompt is tokenized again on every call.
    """

    def _input(self, prompt: Prompt) -> str | list[int]:
        return prompt.text


# -- workloads ----------------------------------------------------------------------------

EXAMPLES = [
    ("What is the capital of France?", "Paris", "It is in Europe."),
    ("What is 12 plus 30?", "42", "It is an even number."),
    ("What color is grass?", "Green", "It is the color of leaves too."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare", "He was an English playwright."),
    ("What is the largest ocean?", "The Pacific Ocean", "It covers about a third of Earth."),
    ("How many legs does a spider have?", "Eight", "Insects have six."),
    ("What is the boiling point of water?", "100 degrees Celsius", "At sea level."),
    ("What is the capital of Japan?", "Tokyo", "It is a very large city."),
]
FEW_SHOT = "Answer each question briefly, then add one more fact.\n\n" + "".join(
    f"Q: {q}\nA: {a}\nMore: {m}\n\n" for q, a, m in EXAMPLES)
COUNTRIES = ["Italy", "Spain", "Germany", "Egypt", "Brazil", "Canada", "India", "Kenya",
             "Norway", "Peru", "Chile", "China", "Greece", "Mexico", "Poland", "Sweden"]


def questions(n: int) -> list[str]:
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append(f"What is the capital of {COUNTRIES[(i // 2) % len(COUNTRIES)]}?")
        else:
            out.append(f"What is {7 + 3 * i} plus {11 + 5 * i}?")
    return out


@sgl.function
def few_shot_qa(s, question, max_tokens=16):
    s += FEW_SHOT + "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", max_tokens=max_tokens, stop="\n")
    s += "\nMore:" + sgl.gen("more", max_tokens=max_tokens, stop="\n")


TOPICS = ["a city park", "a small bakery", "a school library", "a bicycle shop",
          "a museum", "a train station", "a community garden", "a public pool"]


@sgl.function
def fork_ideas(s, topic, width=4, max_tokens=16):
    s += ("You are planning improvements for a public place. The budget is small, the visitors "
          "are mostly families, and the work must be finished within one month. List practical, "
          "concrete ideas, one per line.\n\n")
    s += f"Place: {topic}\n\n"
    forks = s.fork(width)
    forks += lambda i: f"Idea {i + 1}:"
    forks += sgl.gen("idea", max_tokens=max_tokens, stop="\n")
    forks.join()
    for i, idea in enumerate(s["idea"]):
        s += f"Idea {i + 1}:{idea}\n"
    s += "\nThe best idea is" + sgl.gen("best", max_tokens=max_tokens, stop="\n")


# -- running ------------------------------------------------------------------------------


def run_workload(name: str, backend: sgl.lang.Backend, args: argparse.Namespace
                 ) -> list[sgl.ProgramState]:
    """Run one workload to completion (failures stay in state.error())."""
    if name == "few_shot_qa":
        items = [{"question": q, "max_tokens": args.max_tokens} for q in questions(args.questions)]
        states = few_shot_qa.run_batch(items, backend=backend, temperature=0)
    else:
        items = [{"topic": f"{TOPICS[i % len(TOPICS)]} (site {i})", "width": args.fork_width,
                  "max_tokens": args.max_tokens} for i in range(args.fork_programs)]
        states = fork_ideas.run_batch(items, backend=backend, temperature=0)
    return states


def measure(engine: sgl.Engine, workload: str, execution: Execution, radix: bool,
            args: argparse.Namespace, meta: dict[str, Any]) -> dict[str, Any]:
    backend: sgl.lang.Backend = (EngineBackend(engine) if execution == "tokens"
                                 else TextResendBackend(engine))
    engine.flush_cache()
    before = engine.stats()
    start = time.perf_counter()
    states = run_workload(workload, backend, args)
    seconds = time.perf_counter() - start
    after = engine.stats()
    ok = [s for s in states if s.error() is None]
    # Programs whose final token sequence differs from tokenizing their text: where the text
    # path's re-tokenized prompt no longer matches the KV the model produced.
    noncanonical = sum(s.token_ids() != engine.encode(s.text()) for s in ok)
    programs = args.questions if workload == "few_shot_qa" else args.fork_programs
    prompt = after.prompt_tokens - before.prompt_tokens
    cached = after.cached_tokens - before.cached_tokens
    output = after.output_tokens - before.output_tokens
    return {
        **meta,
        "workload": (f"few_shot_qa x{args.questions}" if workload == "few_shot_qa"
                     else f"fork {args.fork_programs}x{args.fork_width}"),
        "radix_cache": radix,
        "execution": execution,
        "programs": programs,
        "errors": len(states) - len(ok),
        "noncanonical_programs": noncanonical,
        "seconds": round(seconds, 3),
        "programs_per_s": round(programs / seconds, 3),
        "output_tokens": output,
        "output_tok_per_s": round(output / seconds, 2),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cache_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "requests": after.finished_requests - before.finished_requests,
        "max_tokens": args.max_tokens,
    }


def run_meta() -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               text=True, capture_output=True).stdout.strip()
        commit += "+dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "commit": commit,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (f"{'workload':<18} {'radix':<6} {'exec':<7} {'progs/s':>8} {'out tok/s':>10} "
              f"{'prompt tok':>11} {'cache hit':>10} {'seconds':>8} {'errors':>6} {'noncanon':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['workload']:<18} {'on' if r['radix_cache'] else 'off':<6} {r['execution']:<7} "
              f"{r['programs_per_s']:>8.2f} {r['output_tok_per_s']:>10.1f} {r['prompt_tokens']:>11} "
              f"{r['cache_hit_rate']:>10.1%} {r['seconds']:>8.1f} {r['errors']:>6} "
              f"{r['noncanonical_programs']:>8}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the embedded default)")
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--fork-programs", type=int, default=16)
    parser.add_argument("--fork-width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16, help="per gen")
    parser.add_argument("--workloads", nargs="+", default=["few_shot_qa", "fork"],
                        choices=["few_shot_qa", "fork"])
    # radix:execution pairs. Off:text is left out by default: with no cache both modes
    # prefill everything, and it would double the slowest runs.
    parser.add_argument("--configs", nargs="+", default=["on:tokens", "on:text", "off:tokens"],
                        choices=["on:tokens", "on:text", "off:tokens", "off:text"])
    parser.add_argument("--repeat", type=int, default=1, help="runs of each configuration")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON lines file to append to")
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args(argv)

    meta = run_meta()
    rows: list[dict[str, Any]] = []
    configs = [c.split(":") for c in args.configs]
    for radix in dict.fromkeys(r for r, _ in configs):  # one engine per radix setting
        engine = sgl.Engine(args.model, disable_radix_cache=(radix == "off"))
        meta["model"] = args.model or "SmolLM2-135M-Instruct (default)"
        meta["device"] = f"{engine.config.device} {engine.config.dtype}"
        try:
            # Warm-up: the first forwards of a fresh engine are slow (allocations, lazy init).
            few_shot_qa.run(question="What is 1 plus 1?", backend=engine, temperature=0,
                            max_tokens=4)
            executions = [e for r, e in configs if r == radix]
            for repeat in range(args.repeat):
                for workload in args.workloads:
                    # Alternate the order on each repeat, so a load change on a shared
                    # machine does not always favour the same execution mode.
                    for execution in executions if repeat % 2 == 0 else executions[::-1]:
                        row = measure(engine, workload, execution, radix == "on", args, meta)
                        row["repeat"] = repeat
                        rows.append(row)
                    print(f"  done: {row['workload']} radix={radix} exec={execution} "
                          f"in {row['seconds']:.1f} s", file=sys.stderr, flush=True)
        finally:
            engine.close()

    print_table(sorted(rows, key=lambda r: (r["workload"], not r["radix_cache"], r["execution"])))
    if not args.no_save:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"appended {len(rows)} lines to {args.out}")
    return rows


if __name__ == "__main__":
    main()
