"""Structured generation at GPU batch sizes, and the cost of a speculative verify step (issue 13).

    python bench/gpu_json.py [--batches 32,128,256] [--new-tokens 128] [--tokenizer PATH] [--probe] [--cpu]

Llama-3.1-8B shape with random weights (`llama3-8b`, load_format="dummy"), bf16, the default
model's tokenizer (SmolLM2: its 49,152 tokens inside the model's 128,256-entry vocabulary, so
masks are 128k wide), 200-word prompts, 128 new tokens, temperature 0.7, one seed per request.
The schema has a nested object, an array of strings and a `pattern`; `--schema short` bounds
every string of it (see `ShortProfile`).

Table 1, per batch size (all requests submitted at once): plain decoding (no constraint, EOS
ignored), JSON with jump-forward off, JSON with jump-forward on, and JSON with jump-forward on
plus n-gram speculation (a second engine). Figures: output tokens/s, engine steps, wall ms per
step, and the step time measured on the GPU split by step kind (CUDA events around every
step: decode-graph steps vs extend steps), and the decode period: the median device time from
one decode step's end to the next one's (the step's real cost, gaps where the device waited
for the host included; wall ms per step also carries the prefill steps and the preparation of
the requests before the first step). The floor for a constrained step is the plain step.

Table 2, single stream: one request whose prompt repeats a sentence (so n-gram drafts are
always proposed), 128 new tokens, greedy, on the plain and the speculative engine: ms per
step, and the verify step (1 + 4 tokens) against the one-token step.

Appends JSON lines to bench/results/gpu_json.jsonl (and $OUT/gpu_json.jsonl when $OUT is set).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Annotated, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_sgl_importable, record, table  # noqa: E402

ensure_sgl_importable()

import torch  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

import sgl  # noqa: E402

MODEL = "llama3-8b"
OUT = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
WORDS = ("river stone cloud lamp apple market winter signal paper garden silver engine harbor "
         "letter forest window planet yellow simple orange travel number spring castle bright "
         "shadow mirror rocket island butter candle wonder thunder silent velvet marble").split()


class Address(BaseModel):
    street: str
    city: str


class Profile(BaseModel):
    name: str
    age: int
    address: Address
    tags: list[str] = Field(max_length=4)
    code: str = Field(pattern=r"^[A-Z]{3}-[0-9]{4}$")


class ShortAddress(BaseModel):
    street: str = Field(max_length=24)
    city: str = Field(max_length=12)


class ShortProfile(BaseModel):
    """`--schema short`: the same structure with every string bounded. Random weights fill an
    unbounded string until max_new_tokens, so with `Profile` forced text (keys, punctuation) is
    a few percent of the output; bounded values end, and the keys after them are a real share,
    as in extraction with a trained model."""
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    address: ShortAddress
    tags: list[Annotated[str, Field(max_length=10)]] = Field(max_length=4)
    code: str = Field(pattern=r"^[A-Z]{3}-[0-9]{4}$")


SCHEMAS = {"profile": Profile, "short": ShortProfile}
SCHEMA: type[BaseModel] = Profile  # --schema


def prompts(n: int, words: int = 200, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["Extract a profile as JSON from this text: " + " ".join(rng.choice(WORDS) for _ in range(words))
            for _ in range(n)]


def emit(workload: str, figures: dict[str, Any]) -> None:
    if SCHEMA is not Profile:
        workload += f" [{SCHEMA.__name__}]"
    row = record("gpu_json", MODEL, workload, figures)
    if OUT is not None:
        with (OUT / "gpu_json.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")


# --cpu: the host side of the same steps on a CPU-only machine: a 2-layer random model with the
# 8B shape's 128,256-entry vocabulary, so schedule / prepare / update / masks do the work they do
# on the GPU host, while the "device" (the CPU worker) stays cheap.
CPU_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=128256, max_position_embeddings=4096, eos_token_id=2)
ON_CPU = False


def make_engine(tokenizer: str, **options: Any) -> sgl.Engine:
    t0 = time.monotonic()
    if ON_CPU:
        e = sgl.Engine(model_config=CPU_TINY, load_format="dummy", device="cpu", tokenizer=tokenizer,
                       max_total_tokens=1 << 18, max_running_requests=256, **options)
        print(f"  engine {options}: ready in {time.monotonic() - t0:.1f} s", flush=True)
        return e
    from sgl.backend.model_loader import PRESETS

    # The 8B shape with the tokenizer's own end token (SmolLM2's <|im_end|>, id 2): the preset's
    # Llama-3 ids (128001, 128009) lie beyond this tokenizer, so a grammar could never stop on
    # them, and a schema completed before max_new_tokens had no allowed token left.
    shape = dict(PRESETS[MODEL], eos_token_id=2)
    # Two engines live at once (plain and speculative): each takes under half the memory.
    e = sgl.Engine(model_config=shape, load_format="dummy", device="cuda", tokenizer=tokenizer,
                   mem_fraction_static=0.42, **options)
    print(f"  engine {options}: ready in {time.monotonic() - t0:.1f} s", flush=True)
    return e


def close(e: sgl.Engine) -> None:
    e.close()
    e._rt = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# CPU time of the step's parts, summed over a run (engine-thread wall time per call).
CPU_PARTS: dict[str, float] = {}


def install_cpu_probe() -> None:
    """Wrap the engine-thread functions a constrained step spends CPU in (class level)."""
    from sgl.backend import grammar, grammar_masks, model_runner, scheduler, step_io

    # (_fill_rows runs on the fill thread: its time is the fill itself; MaskFill.result and
    # StepHandle.resume are where the scheduler thread waits for a fill / enqueues sampling)
    targets = [(grammar.ConstraintState, "accept_token"), (grammar.ConstraintState, "jump_forward"),
               (grammar.GrammarBackend, "fill_bitmasks"), (grammar.GrammarBackend, "_fill_rows"),
               (grammar_masks.MaskFill, "result"), (step_io.StepHandle, "resume"),
               (step_io.StepHandle, "result"), (model_runner.ModelRunner, "start"),
               (scheduler.Scheduler, "schedule"),
               (scheduler.Scheduler, "update"), (model_runner.ModelRunner, "prepare"),
               (model_runner.ModelRunner, "_grammar_masks")]
    for cls, name in targets:
        fn = getattr(cls, name)

        def timed(*a: Any, _fn: Any = fn, _key: str = f"{cls.__name__}.{name}", **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                CPU_PARTS[_key] = CPU_PARTS.get(_key, 0.0) + time.perf_counter() - t0

        setattr(cls, name, timed)


def run(e: sgl.Engine, texts: list[str], **kw: Any) -> dict[str, Any]:
    """All requests at once; wall time, steps and GPU step times by kind."""
    e.flush_cache()
    CPU_PARTS.clear()
    runner = e._rt.runner
    runner.step_events = []
    before = e.stats()

    async def go() -> list[Any]:
        return await asyncio.gather(*(e.generate(t, seed=i + 1, **kw) for i, t in enumerate(texts)),
                                    return_exceptions=True)

    t0 = time.perf_counter()
    outs = asyncio.run(go())
    wall = time.perf_counter() - t0
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    after = e.stats()
    events, runner.step_events = runner.step_events, None
    failed = [o for o in outs if isinstance(o, BaseException)]
    outs = [o for o in outs if not isinstance(o, BaseException)]
    by_kind: dict[str, list[float]] = {}
    for start, end, mode, _bs in events:
        by_kind.setdefault(mode.name.lower(), []).append(start.elapsed_time(end))
    # The decode step's period: device time from one decode step's end to the next one's, so
    # it includes any gap where the device waited for the host (wall ms per step also carries
    # the prefill steps and the requests' preparation before the first step).
    periods = [a[1].elapsed_time(b[1]) for a, b in zip(events, events[1:])
               if a[2].name == b[2].name == "DECODE"]
    tokens = sum(len(o.token_ids) for o in outs)
    steps = after.steps - before.steps
    return dict(
        requests=len(texts), failed=len(failed), output_tokens=tokens, wall_s=round(wall, 2),
        output_tok_s=round(tokens / wall, 1), steps=steps, wall_ms_per_step=round(1e3 * wall / max(steps, 1), 2),
        gpu_ms={k: round(statistics.mean(v), 2) for k, v in by_kind.items()},
        gpu_steps={k: len(v) for k, v in by_kind.items()},
        decode_period_ms=round(statistics.median(periods), 2) if periods else None,
        jump_tokens=after.jump_forward_tokens - before.jump_forward_tokens,
        drafts=after.spec_draft_tokens - before.spec_draft_tokens,
        accepted=after.spec_accepted_tokens - before.spec_accepted_tokens,
        invalid=sum(1 for o in outs if o.finish_reason == "stop" and not _valid(o)),
        # ids the tokenizer does not have (the model's padded vocabulary): the sampler never
        # picks them from finite logits, so each one is a row of non-finite logits
        padded_ids=sum(1 for o in outs for t in o.token_ids if t >= len(e.tokenizer)),
        failed_reasons=sorted({str(x)[:90] for x in failed}),
        cpu_ms_per_step={k: round(1e3 * v / max(steps, 1), 2) for k, v in CPU_PARTS.items()},
    )


def _valid(o: Any) -> bool:
    try:
        SCHEMA.model_validate_json(o.text)
        return True
    except Exception:
        return False


def set_fill_threads(e: sgl.Engine, threads: int | None) -> None:
    """The grammar backend's mask-fill threads (xgrammar's batched matcher; None: "auto")."""
    backend = e._rt.grammar
    backend.fill_threads, backend._batch_matcher = threads, None


def batch_table(e_plain: sgl.Engine, e_spec: sgl.Engine | None, batches: list[int], new: int,
                fill_threads: list[int | None] = ()) -> list[dict]:
    rows = []
    for bs in batches:
        texts = prompts(bs, seed=bs)
        common = dict(max_new_tokens=new, temperature=0.7)
        modes = [("plain", e_plain, dict(ignore_eos=True)),
                 ("json, jump off", e_plain, dict(schema=SCHEMA, jump_forward=False)),
                 ("json, jump on", e_plain, dict(schema=SCHEMA, jump_forward=True))]
        for threads in fill_threads:  # the fill-thread sweep: one more jump-on row each
            modes.append((f"json, jump on, fill threads {threads or 'auto'}", e_plain,
                          dict(schema=SCHEMA, jump_forward=True, _fill_threads=threads)))
        if e_spec is not None:
            modes.append(("json, jump on, ngram", e_spec, dict(schema=SCHEMA, jump_forward=True)))
        base = None
        for name, e, kw in modes:
            if "_fill_threads" in kw:
                set_fill_threads(e, kw.pop("_fill_threads"))
            res = run(e, texts, **common, **kw)
            base = base or res
            res["step_vs_plain"] = round(res["wall_ms_per_step"] / base["wall_ms_per_step"], 2)
            if res["decode_period_ms"] and base["decode_period_ms"]:
                res["period_vs_plain"] = round(res["decode_period_ms"] / base["decode_period_ms"], 2)
            rows.append(dict(batch=bs, mode=name, **res))
            emit(f"json batch {bs}: {name}", res)
            print(json.dumps(rows[-1]), flush=True)
    return rows


def verify_cost(e_plain: sgl.Engine, e_spec: sgl.Engine, new: int) -> list[dict]:
    """Random weights rarely repeat the prompt, so drafts would rarely be proposed: for this
    cost probe the speculative engine's drafter always proposes 4 tokens (the last 4 known
    ones). Acceptance is irrelevant here; every step verifies 1 + 4 tokens."""
    drafter = e_spec._rt.scheduler.drafter
    drafter.propose = lambda r, limit: (r.prompt_ids + r.output_ids)[-limit:] if limit >= 1 else []
    text = "The quick brown fox jumps over the lazy dog. " * 30
    rows = []
    for name, e in (("plain", e_plain), ("ngram, 4 drafts", e_spec)):
        run(e, [text], max_new_tokens=8, temperature=0)  # warm
        res = run(e, [text], max_new_tokens=new, temperature=0, ignore_eos=True)
        rows.append(dict(mode=name, **res))
        emit(f"single stream verify cost: {name}", res)
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="32,128,256")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--tokenizer", default=os.environ.get("SGL_TEST_MODEL"))
    ap.add_argument("--no-spec", action="store_true")
    ap.add_argument("--probe", action="store_true", help="time the CPU parts of each step")
    ap.add_argument("--only-verify", action="store_true")
    ap.add_argument("--schema", choices=sorted(SCHEMAS), default="profile",
                    help="profile: the issue's schema; short: the same with bounded strings")
    ap.add_argument("--cpu", action="store_true", help="host side only: tiny model, 128k vocab, on the CPU")
    ap.add_argument("--pageable-masks", action="store_true",
                    help="A/B: grammar masks in pageable host memory (the default pins them on CUDA)")
    ap.add_argument("--fill-threads", default="", help="e.g. 1,4,auto: extra jump-on rows per mask-fill thread count")
    args = ap.parse_args()
    global SCHEMA
    SCHEMA = SCHEMAS[args.schema]
    if args.cpu:
        global ON_CPU, MODEL
        ON_CPU, MODEL = True, "tiny-128k-vocab (cpu)"
    if args.probe:
        install_cpu_probe()
    if args.pageable_masks:
        from sgl.backend.grammar import GrammarBackend

        pinned = GrammarBackend.allocate_bitmask
        GrammarBackend.allocate_bitmask = lambda self, n, pin=False: pinned(self, n, pin=False)
    if args.tokenizer is None:
        from sgl.backend.model_loader import resolve_model_path

        args.tokenizer = str(resolve_model_path(None))
    batches = [int(b) for b in args.batches.split(",") if b]
    e_plain = make_engine(args.tokenizer)
    run(e_plain, prompts(4), max_new_tokens=16, temperature=0.7, schema=SCHEMA)  # compile, warm
    e_spec = None
    try:
        if not args.no_spec:
            e_spec = make_engine(args.tokenizer, speculative_algorithm="ngram", speculative_num_draft_tokens=4)
            run(e_spec, prompts(4), max_new_tokens=16, temperature=0.7, schema=SCHEMA)
        sweep = [None if t == "auto" else int(t) for t in args.fill_threads.split(",") if t]
        rows = [] if args.only_verify else batch_table(e_plain, e_spec, batches, args.new_tokens, sweep)
        print(table(rows, ["batch", "mode", "output_tok_s", "steps", "wall_ms_per_step", "step_vs_plain",
                           "decode_period_ms", "period_vs_plain", "gpu_ms", "jump_tokens", "drafts", "accepted", "invalid", "failed", "padded_ids"]))
        if e_spec is not None:
            rows = verify_cost(e_plain, e_spec, args.new_tokens)
            print(table(rows, ["mode", "output_tok_s", "steps", "wall_ms_per_step", "gpu_ms", "drafts", "accepted"]))
    finally:
        for e in (e_plain, e_spec):
            if e is not None:
                close(e)


if __name__ == "__main__":
    main()
