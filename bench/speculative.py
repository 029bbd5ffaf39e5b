"""n-gram speculative decoding on the default model: acceptance and single-stream speed.

    python bench/speculative.py [--requests 8] [--draft-tokens 4] [--match text,tokens] [--rounds 1]
                                [--device cpu]

Copy-heavy extraction (the values are copied from the prompt): the `json` workload's prompts
(bench/json_workload.py), one request at a time (single stream), greedy, on engines built in
the same process: plain decoding and `speculative_algorithm="ngram"` with each drafter named in
`--match` (`speculative_ngram_match`: "text", sgl's text-level lookup that also drafts the
grammar's forced text, and "tokens", SGLang's token-id lookup). Each engine runs
the same requests as free text (answer in prose, 96 new tokens, EOS ends) and as JSON (the
workload's schemas, jump-forward on). The engines alternate request by request, so machine
load drifts hit both alike.

Figures per mode: output tokens/s (tokens of the outputs / wall time of the requests, prefill
included), decode tokens/s (the same after each request's first streamed token: what the
drafts can speed up; the prefill, about half of a request's time here, they cannot), engine
steps, and for the speculative engine drafts proposed, accepted, acceptance rate and tokens per
verify step. The outputs must be identical token for token (checked; a difference is printed
and fails the run). Appends one JSON line per mode to bench/results/speculative.jsonl.

`--rounds N` measures the whole set N times (every engine's prefix cache flushed before each
round, so each round prefills what the first did) and reports each engine's median round:
one round of the JSON set is ~2 s of wall time, and on a shared VM single rounds of the same
code read 1.00-1.49x.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record, table  # noqa: E402
from json_workload import workload  # noqa: E402

import sgl  # noqa: E402


def _one(engine: sgl.Engine, messages: Any, kw: dict[str, Any]) -> tuple[Any, float, float, int]:
    """(output, seconds, seconds to the first streamed token, tokens in that first chunk)."""
    async def go() -> tuple[Any, float, float, int]:
        start = time.perf_counter()
        first, first_tokens, out = 0.0, 0, None
        async for chunk in engine.stream(messages, **kw):
            if not first and chunk.token_ids:
                first, first_tokens = time.perf_counter() - start, len(chunk.token_ids)
            if chunk.output is not None:
                out = chunk.output
        return out, time.perf_counter() - start, first, first_tokens

    return asyncio.run(go())


def measure(engines: dict[str, sgl.Engine], requests: list[tuple[Any, Any]], constrained: bool,
            max_new_tokens: int) -> dict[str, dict[str, float]]:
    totals = {name: {"tokens": 0, "seconds": 0.0, "decode_tokens": 0, "decode_seconds": 0.0}
              for name in engines}
    before = {name: e.stats() for name, e in engines.items()}
    for schema, messages in requests:
        kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, temperature=0)
        if constrained:
            kw["schema"] = schema
        outs = {}
        for name, engine in engines.items():
            out, seconds, first, first_tokens = _one(engine, messages, kw)
            outs[name] = out
            totals[name]["tokens"] += len(out.token_ids)
            totals[name]["seconds"] += seconds
            totals[name]["decode_tokens"] += len(out.token_ids) - first_tokens
            totals[name]["decode_seconds"] += seconds - first
        first, *rest = outs.values()
        for other in rest:
            if other.token_ids != first.token_ids:
                raise SystemExit(f"outputs differ:\n{first.text!r}\n{other.text!r}")
    figures = {}
    for name, engine in engines.items():
        after, b = engine.stats(), before[name]
        t = totals[name]
        drafts = after.spec_draft_tokens - b.spec_draft_tokens
        accepted = after.spec_accepted_tokens - b.spec_accepted_tokens
        verify = after.spec_verify_steps - b.spec_verify_steps
        figures[name] = dict(
            tokens=t["tokens"], seconds=round(t["seconds"], 2),
            tok_s=round(t["tokens"] / t["seconds"], 1),
            decode_tok_s=round(t["decode_tokens"] / t["decode_seconds"], 1),
            steps=after.steps - b.steps,
            drafts=drafts, accepted=accepted,
            acceptance=round(accepted / drafts, 3) if drafts else 0.0,
            tokens_per_verify_step=round(1 + accepted / verify, 2) if verify else 0.0,
        )
    return figures


def _median_round(rounds: list[dict[str, dict[str, float]]], name: str) -> dict[str, Any]:
    """`name`'s figures over the rounds: tok_s, decode_tok_s and seconds the median of its own
    rounds, speedup and decode_speedup the median of its per-round ratios to plain (same
    round), every round's speedup listed; the counts (steps, drafts, ...) are the same every
    round (greedy, caches flushed)."""
    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    figures = dict(rounds[0][name])
    for key in ("tok_s", "decode_tok_s", "seconds"):
        figures[key] = median([r[name][key] for r in rounds])
    speedups = [r[name]["tok_s"] / r["plain"]["tok_s"] for r in rounds]
    figures["speedup"] = round(median(speedups), 2)
    figures["decode_speedup"] = round(median(
        [r[name]["decode_tok_s"] / r["plain"]["decode_tok_s"] for r in rounds]), 2)
    figures["round_speedups"] = " ".join(f"{x:.2f}" for x in speedups)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--min-window", type=int, default=1, help="speculative_ngram_min_match_window_size")
    ap.add_argument("--match", default="text,tokens", help="speculative_ngram_match values, one engine each")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=1, help="median of this many rounds")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    engines = {"plain": sgl.Engine(device=args.device)}
    for match in args.match.split(","):
        engines[f"ngram {match}"] = sgl.Engine(
            device=args.device, speculative_algorithm="ngram", speculative_ngram_match=match,
            speculative_num_draft_tokens=args.draft_tokens,
            speculative_ngram_min_match_window_size=args.min_window,
            speculative_ngram_max_match_window_size=max(4, args.min_window))
    requests = workload(args.requests, seed=1)
    for engine in engines.values():  # warm every engine
        _one(engine, requests[0][1], dict(max_new_tokens=4))
    rows = []
    for constrained in (False, True):
        rounds = []
        for _ in range(args.rounds):
            for engine in engines.values():
                engine.flush_cache()
            rounds.append(measure(engines, requests, constrained, args.max_new_tokens))
        figures = {name: _median_round(rounds, name) for name in engines}
        for name, f in figures.items():
            mode = "json" if constrained else "free text"
            rows.append(dict(mode=mode, engine=name, **f))
            if not args.no_record:
                record("speculative", f"SmolLM2-135M-Instruct ({args.device})",
                       f"extraction single stream, {mode}, {args.requests} requests",
                       dict(engine=name, draft_tokens=args.draft_tokens, min_window=args.min_window,
                            rounds=args.rounds, **f))
    print(table(rows, ["mode", "engine", "tok_s", "speedup", "round_speedups", "decode_tok_s",
                       "decode_speedup", "steps", "tokens", "drafts", "accepted", "acceptance",
                       "tokens_per_verify_step"]))
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    main()
