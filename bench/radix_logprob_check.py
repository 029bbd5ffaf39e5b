"""Prompt log-probabilities with the radix cache on equal those with it off (issue 16's check).

Six chat prompts are rendered with the model's template and continued greedily for 64 tokens
by transformers in float32; then engines score the six sequences one after another
(`max_new_tokens=1, return_logprob=True, logprob_start_len=0`), and their prompt
log-probabilities are compared with transformers' float32 ones. The radix cache serves the
shared template to every sequence after the first.

    python bench/radix_logprob_check.py [--model PATH.gguf] [--device cuda] [--runs 10]

Prints one row per engine variant (largest and mean absolute difference, in nats) and writes
a JSON line per variant through bench/common.record.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_sgl_importable, record, table  # noqa: E402

ensure_sgl_importable()

import torch  # noqa: E402

import sgl  # noqa: E402

PROMPTS = [
    "Name three rivers in Africa and one fact about each.",
    "Explain why the sky looks blue.",
    "Write a haiku about a lighthouse in winter.",
    "What is 17 times 23? Show the steps.",
    "List four uses of a paperclip.",
    "Give a one-line definition of entropy for a child.",
]


def reference_sequences(model: str | None, device: str) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy 64-token continuations by transformers (float32) and their token logprobs."""
    from sgl.backend.model_loader import resolve_model_path
    from sgl.backend.reference import load_reference_model
    from sgl.backend.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path(model))
    ref = load_reference_model(model, torch.float32).to(device)
    seqs, lps = [], []
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            full = ref.generate(x, max_new_tokens=64, do_sample=False)[0]
            logits = ref(full[None]).logits[0].float()  # [L, vocab]
        lp = torch.log_softmax(logits[:-1], -1).gather(1, full[1:, None])[:, 0]  # [L-1]
        seqs.append(full.tolist())
        lps.append(lp.tolist())
    return seqs, lps


async def score(e: sgl.Engine, seqs: list[list[int]]) -> list[list[float]]:
    out = []
    for s in seqs:
        r = await e.generate(input_ids=s, max_new_tokens=1, temperature=0, return_logprob=True,
                             logprob_start_len=0)
        out.append([t.logprob for t in r.logprobs.prompt if not math.isnan(t.logprob)])
    return out


def compare(got: list[list[float]], want: list[list[float]]) -> tuple[float, float]:
    diffs = [abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w, strict=True)]
    return max(diffs), sum(diffs) / len(diffs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--runs", type=int, default=10, help="runs of the cached bfloat16 engine")
    args = ap.parse_args()
    seqs, want = reference_sequences(args.model, args.device)
    variants: list[tuple[str, dict[str, Any]]] = [
        ("bfloat16, radix off", dict(dtype="bfloat16", disable_radix_cache=True)),
        ("float32, radix off", dict(dtype="float32", disable_radix_cache=True)),
        ("float32, radix on", dict(dtype="float32")),
    ] + [(f"bfloat16, radix on, run {i + 1}", dict(dtype="bfloat16")) for i in range(args.runs)]
    rows = []
    for name, opts in variants:
        with sgl.Engine(args.model, device=args.device, debug_integrity=True, **opts) as e:
            worst, mean = compare(asyncio.run(score(e, seqs)), want)
        rows.append({"engine": name, "max_abs_nats": round(worst, 4), "mean_abs_nats": round(mean, 5)})
        record("radix_logprob_check", args.model or "SmolLM2-135M-Instruct", name, rows[-1])
    print(table(rows, ["engine", "max_abs_nats", "mean_abs_nats"]))


if __name__ == "__main__":
    main()
