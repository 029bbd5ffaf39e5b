"""xgrammar adapter: compile cache, one matcher per request, batch bitmasks, jump-forward.

How the engine drives it (see also `grammar_jump.py` for the jump-forward plan)::

    backend = GrammarBackend(tokenizer, vocab_size=model_vocab_size)
    # in generate(), awaited BEFORE queueing (raises InvalidConstraintError); the compile runs
    # on a worker thread with a time limit (grammar_compiler.py), the event loop keeps going:
    compiled = await backend.compile_async(kind, spec, timeout=10.0)  # cached by (kind, spec)
    # when the request is admitted (engine thread):
    req.grammar = backend.new_state(compiled)
    # each step, for the batch (rows of unconstrained requests stay all ones):
    backend.fill_bitmasks([r.grammar for r in batch], bitmask)  # [B, ceil(V/32)] int32, CPU
    apply_bitmask(logits, bitmask)                         # logits [B, V], on logits' device
    # after sampling token t for a constrained request:
    req.grammar.accept_token(t)        # False means a bug (the mask allowed it): abort the request
    plan = req.grammar.jump_forward(req.output_ids, max_new_tokens=budget_left)
    # (None when the grammar's forced text has no known bound: grammar_forcing.py)
    if plan: drop plan.rollback output tokens (+KV), append plan.append_ids, then
             req.grammar.apply(plan); the next forward of the request is an extend.

Regex constraints: xgrammar, not interegular. The choice: xgrammar compiles a regex to the
same byte-level pushdown automaton it uses for JSON Schema and EBNF, so one matcher type, one
token-mask path (precomputed per-state token sets, a few microseconds a row) and one
jump-forward query (`find_jump_forward_string`) serve all three kinds, with rollback for free.
interegular gives a character-level FSM only: we would have to build and cache our own
token-level index over the 49k-token vocabulary (outlines-style, seconds per regex), handle
byte-level tokens that split UTF-8 characters, and keep a second jump-forward implementation
that could disagree with the first. Its one advantage, pure-Python regex analysis, is not
needed: xgrammar reports invalid regexes (lookarounds, backreferences) at compile time, which
is when we must reject them anyway.

Thread safety: `compile` may be called from any thread (the compiler is thread-safe; our
cache is locked and deduplicates concurrent compiles of one spec); a `ConstraintState` belongs
to one request and is only touched by the engine thread.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Sequence

import numpy as np
import torch
import xgrammar as xgr

# Re-exported: the jump-forward planner is part of this adapter's API (split only for size).
from sgl.backend.grammar_compiler import CompiledConstraint, ConstraintCompiler, ConstraintKind
from sgl.backend.grammar_jump import (
    MIN_JUMP_CHARS,
    BoundaryCache,
    JumpPlan,
    apply_plan,
    plan_jump_forward,
)
from sgl.backend.grammar_masks import MaskFill

__all__ = [
    "CompiledConstraint",
    "ConstraintKind",
    "ConstraintState",
    "GrammarBackend",
    "JumpPlan",
    "MaskFill",
    "apply_plan",
    "plan_jump_forward",
    "allocate_bitmask",
    "apply_bitmask",
    "bitmask_to_bool",
    "fill_bitmasks",
]


class GrammarBackend:
    """Compiles constraints for one tokenizer and makes per-request matchers.

    `vocab_size` is the model's logits width, which may exceed `len(tokenizer)` (padded
    embeddings): ids past the tokenizer are never allowed. xgrammar sees only the tokenizer's
    ids (`mask_vocab_size`) and masks are that wide; the sampler forbids the columns past them.
    (Telling xgrammar the padded width makes every padding id a "special token" it checks on
    each call: with SmolLM2's 49,152 tokens in a 128,256-wide model, a mask fill cost 12x more
    and an accept 13x.) JSON schemas are compiled to a
    fixed layout (no free whitespace; `json_indent` spaces of indentation, or one line with
    ", " and ": " separators when None), so the layout is forced and jump-forward can skip it.
    Compiling runs on `compile_workers` threads with a cache of at most `cache_bytes`
    (`grammar_compiler.py`); a jump-forward appends at most `max_jump_forward_tokens` tokens.
    Masks of batches of at least 8 constrained rows are filled by xgrammar's batched matcher
    on `fill_threads` threads (None: half the machine's cores, xgrammar's "auto"), and
    `fill_bitmasks_async` runs the fill beside the step's forward (grammar_masks.py).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        *,
        json_indent: int | None = 2,
        stop_token_ids: Sequence[int] | None = None,
        cache_bytes: int = 256 << 20,
        compile_workers: int = 2,
        max_jump_forward_tokens: int = 64,
        max_threads: int = 8,
        fill_threads: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size) if vocab_size is not None else len(tokenizer)
        self.mask_vocab_size = min(self.vocab_size, len(tokenizer))
        self.json_indent = json_indent
        self.max_jump_forward_tokens = max_jump_forward_tokens
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer,
            vocab_size=self.mask_vocab_size,
            stop_token_ids=list(stop_token_ids) if stop_token_ids else None,
        )
        self.stop_token_ids: tuple[int, ...] = tuple(self.tokenizer_info.stop_token_ids)
        # xgrammar's own cache is off: ours is bounded in bytes and is the only one to clear.
        self.compiler = ConstraintCompiler(
            xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False),
            json_indent=json_indent, cache_bytes=cache_bytes, workers=compile_workers,
        )
        self._batch_matcher: xgr.BatchGrammarMatcher | None = None
        self.fill_threads = fill_threads
        self.boundaries = BoundaryCache()  # jump planning's re-tokenized boundaries (engine thread)
        self._fill_thread: concurrent.futures.ThreadPoolExecutor | None = None

    @staticmethod
    def config_options(config: Any) -> dict[str, int]:
        """The constructor options an `EngineConfig` sets (the per-request limits, size, depth
        and compile time, are applied by `sgl.Engine` when it prepares a request)."""
        return {"cache_bytes": config.grammar_cache_bytes,
                "max_jump_forward_tokens": config.max_jump_forward_tokens}

    # -- compiling (see grammar_compiler.py) ------------------------------------------------

    def compile(self, kind: str, spec: str, timeout: float | None = None) -> CompiledConstraint:
        """Compile (or fetch from the cache) a constraint, blocking the calling thread;
        InvalidConstraintError if invalid or slower than `timeout` seconds."""
        return self.compiler.compile(kind, spec, timeout)

    async def compile_async(
        self, kind: str, spec: str, timeout: float | None = None
    ) -> CompiledConstraint:
        """`compile` on a worker thread, awaited: the caller's event loop keeps running."""
        return await self.compiler.compile_async(kind, spec, timeout)

    def clear_cache(self) -> None:
        """Drop every cached grammar (the engine's flush_cache should call this)."""
        self.compiler.clear_cache()

    @property
    def cache_bytes(self) -> int:
        return self.compiler.cache_bytes

    @property
    def cache_hits(self) -> int:
        return self.compiler.cache_hits

    @property
    def cache_misses(self) -> int:
        return self.compiler.cache_misses

    # -- per request --------------------------------------------------------------------------

    def new_state(self, compiled: CompiledConstraint) -> ConstraintState:
        return ConstraintState(compiled, self.tokenizer, self.stop_token_ids, self.mask_vocab_size,
                               max_jump_tokens=self.max_jump_forward_tokens,
                               boundaries=self.boundaries)

    def allocate_bitmask(self, batch_size: int, pin: bool = False) -> torch.Tensor:
        """[batch_size, ceil(mask_vocab_size / 32)] int32, uninitialized: `fill_bitmasks` and
        `fill_bitmasks_async` write every row (a step's mask is allocated anew each step).

        `pin` (CUDA): page-locked, from torch's caching host allocator, so the mask's
        non-blocking copy to the device is a real asynchronous DMA. From pageable memory the
        driver stages the copy and may wait for the stream, i.e. for the step's forward: the
        host would block there instead of preparing the next step. (The allocator does not
        hand the block out again before the copy recorded on it has run.)"""
        return torch.empty(batch_size, -(-self.mask_vocab_size // 32), dtype=torch.int32,
                           pin_memory=pin)

    def fill_bitmasks(
        self, states: Sequence[ConstraintState | None], bitmask: torch.Tensor
    ) -> bool:
        """`fill_bitmasks` on this backend's thread pool (created on first large batch)."""
        rows, constrained = _prefill_rows(states, bitmask)
        self._fill_rows([states[i].matcher for i in rows], bitmask, rows)  # type: ignore[union-attr]
        return constrained

    def _fill_rows(self, matchers: list[xgr.GrammarMatcher], bitmask: torch.Tensor,
                   rows: list[int]) -> None:
        """The matchers' allowed tokens into their rows: xgrammar's C++, without the GIL."""
        if len(rows) >= _BATCH_THRESHOLD:
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher(self.fill_threads or "auto")
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        else:
            for m, i in zip(matchers, rows):
                m.fill_next_token_bitmask(bitmask, i)

    def fill_bitmasks_async(
        self, states: Sequence[ConstraintState | None], bitmask: torch.Tensor
    ) -> MaskFill:
        """`fill_bitmasks` on this backend's fill thread, for the runner to wait on just
        before sampling (grammar_masks.py). Fewer than 8 rows to fill fill here and now: the
        hand-off would cost more than the fill.

        The Python part (terminated rows, the list of matchers) runs here, and this thread
        waits until the fill thread is inside xgrammar: a thread that needs the GIL while
        another runs Python waits up to the interpreter's switch interval (5 ms), which
        measured as a 256-row fill taking 9.5 ms beside the scheduler instead of 2.5."""
        rows, constrained = _prefill_rows(states, bitmask)
        matchers = [states[i].matcher for i in rows]  # type: ignore[union-attr]
        if len(rows) < _BATCH_THRESHOLD:
            self._fill_rows(matchers, bitmask, rows)
            return MaskFill(bitmask, constrained=constrained)
        if self._fill_thread is None:
            self._fill_thread = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="sgl-grammar-fill")
        entered = threading.Event()

        def fill() -> bool:
            entered.set()
            self._fill_rows(matchers, bitmask, rows)
            return constrained

        masks = MaskFill.start(self._fill_thread, fill, bitmask)
        entered.wait()
        return masks

    def close(self) -> None:
        """Stop the fill thread (after the fill in progress, if any)."""
        if self._fill_thread is not None:
            self._fill_thread.shutdown(wait=True)
            self._fill_thread = None


class ConstraintState:
    """The grammar state of one request: an xgrammar matcher plus its accepted-token count.

    Invariant: the matcher has accepted exactly the request's output tokens, in order
    (`num_accepted == len(output_ids)` until a stop token terminates it). Rollback and
    jump-forward rely on it.
    """

    def __init__(
        self,
        compiled: CompiledConstraint,
        tokenizer: Any,
        stop_token_ids: Sequence[int],
        vocab_size: int,
        *,
        max_jump_tokens: int = 64,
        boundaries: BoundaryCache | None = None,
    ) -> None:
        self.compiled = compiled
        self.boundaries = boundaries if boundaries is not None else BoundaryCache()
        self.max_jump_tokens = max_jump_tokens
        self.tokenizer = tokenizer
        self.stop_token_ids = tuple(stop_token_ids)
        self.vocab_size = vocab_size
        self.matcher = xgr.GrammarMatcher(compiled.grammar)
        self.num_accepted = 0
        self.num_jumps = 0
        self.num_jump_tokens = 0  # tokens appended by jumps, net of rollbacks

    def accept_token(self, token_id: int) -> bool:
        """Advance on a sampled token; False (state unchanged) if the grammar forbids it."""
        accepted = self.matcher.accept_token(int(token_id))
        if accepted:
            self.num_accepted += 1
        return accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (CPU int32, one bit per token)."""
        if self.matcher.is_terminated():
            # Nothing may follow the stop token; allow the stop tokens so a row that is still
            # scheduled (e.g. overlap scheduling one step late) samples something harmless.
            _only_tokens(bitmask, row, self.stop_token_ids)
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        """True once a stop token was accepted after a complete match."""
        return self.matcher.is_terminated()

    def is_completed(self) -> bool:
        """True if the text so far is a complete match (a stop token may come next)."""
        return self.matcher.is_completed()

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens (the engine drops them too)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} tokens")
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def allowed_only_eos(self) -> bool:
        """True if the grammar is complete and only a stop token may follow."""
        if self.matcher.is_terminated():
            return True
        if not self.matcher.is_completed():
            return False
        return _allows_only_stop(self.matcher, self.vocab_size, self.stop_token_ids)

    # -- jump-forward -------------------------------------------------------------------------

    def jump_forward(
        self, output_ids: Sequence[int], *, max_new_tokens: int | None = None, **options: Any
    ) -> JumpPlan | None:
        """Plan a jump over the forced continuation; see `grammar_jump.plan_jump_forward`.

        None, without asking xgrammar, when the grammar's forced text has no known bound
        (`CompiledConstraint.forced_bound`): xgrammar's walk might never return. At most
        `max_jump_tokens` tokens are appended, and never more than `max_new_tokens`.
        """
        if self.compiled.forced_bound is None or self.matcher.is_terminated():
            return None
        # Most calls (after every sampled token) find no forced text worth a jump: decided
        # here, before the planner's set-up (which asks again, ~0.5 us, when there is).
        if len(self.matcher.find_jump_forward_string()) < options.get("min_chars", MIN_JUMP_CHARS):
            return None
        options.setdefault("max_jump_tokens", self.max_jump_tokens)
        options.setdefault("cache", self.boundaries)
        return plan_jump_forward(
            self.tokenizer, self, output_ids, max_new_tokens=max_new_tokens, **options
        )

    def apply(self, plan: JumpPlan) -> None:
        """Move the matcher as the plan says (after the engine applied it to the request)."""
        apply_plan(self, plan)


# -- bitmasks -----------------------------------------------------------------------------------


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """A [batch_size, ceil(vocab_size / 32)] int32 CPU mask, all ones (everything allowed)."""
    return xgr.allocate_token_bitmask(batch_size, vocab_size)


_BATCH_THRESHOLD = 8  # below this, the thread pool's hand-off costs more than it saves


def _prefill_rows(states: Sequence[ConstraintState | None], bitmask: torch.Tensor) -> tuple[list[int], bool]:
    """Rows of unconstrained requests (None) become all ones and terminated matchers allow only
    their stop tokens; returns (the rows whose matcher must fill, whether any row is
    constrained, i.e. whether `apply_bitmask` is needed at all)."""
    rows, free = [], []
    for i, state in enumerate(states):
        if state is None:
            free.append(i)
            continue
        if state.is_terminated():
            state.fill_bitmask(bitmask, i)
        else:
            rows.append(i)
    if free:  # (xgrammar writes whole rows: only these need the ones)
        bitmask.index_fill_(0, torch.tensor(free), -1)
    return rows, len(free) < len(states)


def fill_bitmasks(states: Sequence[ConstraintState | None], bitmask: torch.Tensor) -> bool:
    """Fill one row per request (see `_prefill_rows`) on this thread, row by row (a backend's
    `fill_bitmasks` uses its thread pool for large batches). Returns whether any row is
    constrained."""
    rows, constrained = _prefill_rows(states, bitmask)
    for i in rows:
        states[i].fill_bitmask(bitmask, i)  # type: ignore[union-attr]
    return constrained


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int | None = None
) -> None:
    """Set disallowed logits to -inf in place. logits: [B, V] on any device; bitmask: CPU."""
    from sgl.backend.kernels import dispatch

    mask = bitmask[: logits.shape[0]].to(logits.device, non_blocking=True)
    if vocab_size is not None:
        logits = logits[:, :vocab_size]
    dispatch.apply_token_bitmask(logits, mask)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Pure-torch unpacking: [B, ceil(V/32)] int32 -> [B, V] bool (True = allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]; bit j of word w is token 32w+j
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _only_tokens(bitmask: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    bitmask[row].zero_()
    for token in token_ids:
        word, bit = divmod(int(token), 32)
        value = int(bitmask[row, word]) | (1 << bit)
        bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # int32 wrap


def _allows_only_stop(matcher: xgr.GrammarMatcher, vocab_size: int, stops: Sequence[int]) -> bool:
    """Whether the matcher allows some token and only stop tokens. Compared word by word in
    numpy: unpacking the mask to 49k booleans in torch took 1-4 ms on the CPU (once per jump
    that reaches a grammar's end)."""
    mask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(mask, 0)
    words = mask.numpy()[0].view(np.uint32).copy()  # bit j of word w: token 32w + j
    unused = words.size * 32 - vocab_size  # bits past the last token are not tokens
    if unused:
        words[-1] &= np.uint32((1 << (32 - unused)) - 1)
    stop_mask = torch.empty_like(mask)
    _only_tokens(stop_mask, 0, [t for t in stops if 0 <= t < vocab_size])
    stop_words = stop_mask.numpy()[0].view(np.uint32)
    return bool(words.any()) and not (words & ~stop_words).any()
