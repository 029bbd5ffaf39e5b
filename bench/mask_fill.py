"""Grammar mask fill time per request: one thread vs xgrammar's batched fill, 49k and 128k vocab.

    python bench/mask_fill.py [--batch 32 128] [--threads 1 2 4 8] [--repeat 5]

The vocabularies: SmolLM2's own 49,152 tokens, and a 128,256-token one (Llama-3's size) made
offline from it: SmolLM2's tokens plus distinct concatenations of two of them, so the extra
tokens have a real tokenizer's character mix (a vocab padded with never-allowed ids would
measure nothing). The constraint is the issue-13 schema: a nested object, an array of strings
and a `pattern`. Each request's matcher is advanced to a different point of a valid document
(inside keys, strings, numbers, the array...), as a running batch's would be.

Prints ms per step and us per request for: rows filled one after another on this thread (what
`fill_bitmasks` does below its threshold), and `BatchGrammarMatcher` with N threads; plus
whether the batched fill lets another Python thread run meanwhile (it must, for the masks to
be filled behind the device's step).
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from typing import Any

import xgrammar as xgr

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city", "zip"]},
    },
    "required": ["name", "age", "email", "tags", "address"],
}
DOCUMENT = {"name": "Maria Lopez", "age": 34, "email": "maria.lopez@example.com",
            "tags": ["green", "hiking", "jazz"],
            "address": {"street": "12 Calle Mayor", "city": "Madrid", "zip": "28013"}}


def smollm2_vocab() -> list[bytes]:
    from sgl.backend.model_loader import resolve_model_path
    from sgl.backend.tokenizer import load_tokenizer

    path = resolve_model_path(None)
    tok = load_tokenizer(path)
    info = xgr.TokenizerInfo.from_huggingface(tok)
    return [t if isinstance(t, bytes) else t.encode() for t in info.decoded_vocab]


def padded_vocab(vocab: list[bytes], size: int, seed: int = 0) -> list[bytes]:
    """`vocab` plus distinct two-token concatenations up to `size` tokens."""
    rng = random.Random(seed)
    words = [t for t in vocab if 0 < len(t) <= 8]
    seen, out = set(vocab), list(vocab)
    while len(out) < size:
        t = rng.choice(words) + rng.choice(words)
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


def matchers(compiled: xgr.CompiledGrammar, n: int, seed: int = 0) -> list[xgr.GrammarMatcher]:
    text = json.dumps(DOCUMENT, indent=2)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        m = xgr.GrammarMatcher(compiled)
        cut = rng.randrange(1, len(text) - 1)
        assert m.accept_string(text[:cut]), cut
        out.append(m)
    return out


def time_fill(fill: Any, repeat: int) -> float:
    fill()  # warm up
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fill()
        best = min(best, time.perf_counter() - start)
    return best


def gil_free_fraction(batch: xgr.BatchGrammarMatcher, ms: list[xgr.GrammarMatcher], mask: Any) -> float:
    """How much pure-Python counting another thread does during batched fills, relative to
    the same time alone (1.0: the fill never holds the GIL; ~0: it holds it throughout)."""

    def count(seconds: float) -> int:
        end, n = time.perf_counter() + seconds, 0
        while time.perf_counter() < end:
            n += 1
        return n

    start = time.perf_counter()
    for _ in range(5):
        batch.batch_fill_next_token_bitmask(ms, mask)
    seconds = time.perf_counter() - start
    alone = count(seconds)
    box: dict[str, int] = {}
    thread = threading.Thread(target=lambda: box.update(n=count(seconds)))
    thread.start()
    for _ in range(5):
        batch.batch_fill_next_token_bitmask(ms, mask)
    thread.join()
    return box["n"] / alone


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    base = smollm2_vocab()
    for size in (len(base), 128256):
        vocab = base if size == len(base) else padded_vocab(base, size)
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=size)
        start = time.perf_counter()
        compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
            json.dumps(SCHEMA), any_whitespace=False, indent=2)
        print(f"vocab {size}: schema compiled in {time.perf_counter() - start:.2f} s")
        for bs in args.batch:
            ms = matchers(compiled, bs)
            mask = xgr.allocate_token_bitmask(bs, size)

            def serial() -> None:
                for i, m in enumerate(ms):
                    m.fill_next_token_bitmask(mask, i)

            t = time_fill(serial, args.repeat)
            print(f"  batch {bs:4d} serial      : {t * 1e3:7.2f} ms/step {t / bs * 1e6:7.1f} us/req")
            for threads in args.threads:
                batch = xgr.BatchGrammarMatcher(threads)
                t = time_fill(lambda: batch.batch_fill_next_token_bitmask(ms, mask), args.repeat)
                print(f"  batch {bs:4d} {threads:2d} threads : {t * 1e3:7.2f} ms/step "
                      f"{t / bs * 1e6:7.1f} us/req")
            print(f"  batch {bs:4d} other Python thread's speed during batched fills: "
                  f"{gil_free_fraction(xgr.BatchGrammarMatcher(args.threads[-1]), ms, mask):.2f}")


if __name__ == "__main__":
    main()
