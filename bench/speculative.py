"""n-gram speculative decoding on the default model: acceptance and single-stream speed.

    python bench/speculative.py [--requests 8] [--draft-tokens 4] [--match text,tokens] [--device cpu]

Copy-heavy extraction (the values are copied from the prompt): the `json` workload's prompts
(bench/json_workload.py), one request at a time (single stream), greedy, on engines built in
the same process: plain decoding and `speculative_algorithm="ngram"` with each drafter named in
`--match` (`speculative_ngram_match`: "text", sgl's text-level lookup that also drafts the
grammar's forced text, and "tokens", SGLang's token-id lookup). Each engine runs
the same requests as free text (answer in prose, 96 new tokens, EOS ends) and as JSON (the
workload's schemas, jump-forward on). The engines alternate request by request, so machine
load drifts hit both alike.

Figures per mode: output tokens/s (tokens of the outputs / wall time of the requests), engine
steps, and for the speculative engine drafts proposed, accepted, acceptance rate and tokens per
verify step. The outputs must be identical token for token (checked; a difference is printed
and fails the run). Appends one JSON line per mode to bench/results/speculative.jsonl.
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


def _one(engine: sgl.Engine, messages: Any, kw: dict[str, Any]) -> tuple[sgl.GenerateOutput, float]:
    start = time.perf_counter()
    out = asyncio.run(engine.generate(messages, **kw))
    return out, time.perf_counter() - start


def measure(engines: dict[str, sgl.Engine], requests: list[tuple[Any, Any]], constrained: bool,
            max_new_tokens: int) -> dict[str, dict[str, float]]:
    totals = {name: {"tokens": 0, "seconds": 0.0} for name in engines}
    before = {name: e.stats() for name, e in engines.items()}
    for schema, messages in requests:
        kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, temperature=0)
        if constrained:
            kw["schema"] = schema
        outs = {}
        for name, engine in engines.items():
            out, seconds = _one(engine, messages, kw)
            outs[name] = out
            totals[name]["tokens"] += len(out.token_ids)
            totals[name]["seconds"] += seconds
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
            tok_s=round(t["tokens"] / t["seconds"], 1), steps=after.steps - b.steps,
            drafts=drafts, accepted=accepted,
            acceptance=round(accepted / drafts, 3) if drafts else 0.0,
            tokens_per_verify_step=round(1 + accepted / verify, 2) if verify else 0.0,
        )
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--min-window", type=int, default=1, help="speculative_ngram_min_match_window_size")
    ap.add_argument("--match", default="text,tokens", help="speculative_ngram_match values, one engine each")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--device", default="cpu")
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
        figures = measure(engines, requests, constrained, args.max_new_tokens)
        base = figures["plain"]["tok_s"]
        for name, f in figures.items():
            mode = "json" if constrained else "free text"
            rows.append(dict(mode=mode, engine=name, **f, speedup=round(f["tok_s"] / base, 2)))
            if not args.no_record:
                record("speculative", f"SmolLM2-135M-Instruct ({args.device})",
                       f"extraction single stream, {mode}, {args.requests} requests",
                       dict(engine=name, draft_tokens=args.draft_tokens, min_window=args.min_window, **f))
    print(table(rows, ["mode", "engine", "tok_s", "speedup", "steps", "tokens", "drafts", "accepted",
                       "acceptance", "tokens_per_verify_step"]))
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    main()
