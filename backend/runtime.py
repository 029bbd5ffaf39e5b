"""Runtime: builds and owns every part of an engine. The one seam `sgl.Engine` imports.

Construction order: resolve the device -> load model and tokenizer -> resolve the sizes
(`resolve_sizes`, pure: the KV pool from what memory is left) -> pool, prefix cache, sampler,
runner (and CUDA graphs), scheduler -> start the engine thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import torch

from sgl._spec import RequestSpec
from sgl.backend import gc_freeze
from sgl.backend.model_source import resolve_model_source
from sgl.backend.quant.cpu_layer import MAX_ROWS as CPU_DECODE_ROWS
from sgl.backend.quant.policy import (check_activation_quantization, check_deterministic,
                                      check_fp8_device, require_float8_gpu,
                                      require_gguf_model, resolve_activation_quantization,
                                      resolve_quantization)
from sgl.backend.req import Req
from sgl.backend.spec_text import PieceTable, TextDrafter
from sgl.backend.speculative import NgramDrafter, SpecConfig
from sgl.config import EngineConfig
from sgl.errors import InvalidConfigError

if TYPE_CHECKING:
    from sgl.backend.grammar import GrammarBackend

logger = logging.getLogger("sgl.engine")

CPU_KV_BYTES_CAP = 2 << 30  # the default CPU pool never takes more than 2 GiB
CPU_MEM_FRACTION = 0.2
GPU_MEM_FRACTION = 0.85
# The CPU's default cap on running requests: every decode step then fits the one-call quantized
# decode step (cpu_layer.MAX_ROWS rows; a larger step would run the op path).
CPU_MAX_RUNNING = CPU_DECODE_ROWS
# kv_cache_dtype "auto" on the CPU under a float32 model (docs/benchmarks.md, "Quantized
# weights on the CPU", gives the fidelity evidence for the choice).
CPU_AUTO_KV_CACHE_DTYPE = "float16"


def resolve_device(config: EngineConfig) -> EngineConfig:
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidConfigError(f"device={config.device!r}: CUDA is not available on this machine")
    dtype = config.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    no_overlap = config.disable_overlap_schedule
    if no_overlap is None:
        no_overlap = not device.startswith("cuda")
    quantization = resolve_quantization(config, device)
    activations = resolve_activation_quantization(config.activation_quantization, quantization)
    resolved = config.replace(device=device, dtype=dtype, disable_overlap_schedule=no_overlap,
                              quantization=quantization, activation_quantization=activations,
                              kv_cache_dtype=resolve_kv_cache_dtype(config.kv_cache_dtype,
                                                                    device, dtype))
    check_deterministic(resolved)
    return resolved


def resolve_kv_cache_dtype(kv_cache_dtype: str, device: str, dtype: str) -> str:
    """The KV pool's dtype name (`kv_dtype` gives its torch dtype) for a resolved device and
    model dtype. A 16-bit pool under a float32 model is a CPU feature: the C ops round on
    store and widen on read (quant/cpu_ops.c), the torch attention widens on read. On CUDA the
    pool is the model's dtype or float8 e4m3: the Triton stores round into it, the Triton
    attention widens each tile it loads, the torch attention widens what it gathers."""
    kv = {"bf16": "bfloat16", "fp8": "fp8_e4m3"}.get(kv_cache_dtype, kv_cache_dtype)
    if device.startswith("cuda"):
        if kv not in ("auto", dtype, "fp8_e4m3"):
            raise InvalidConfigError(
                f"kv_cache_dtype={kv_cache_dtype!r}: on CUDA the KV cache is kept in the model's "
                f"dtype ({dtype}) or in float8: use 'auto' or 'fp8_e4m3' (or set dtype)")
        return dtype if kv == "auto" else kv
    if kv == "auto":
        return CPU_AUTO_KV_CACHE_DTYPE if dtype == "float32" else dtype
    return kv


def kv_dtype(kv_cache_dtype: str) -> torch.dtype:
    """The torch dtype of a resolved `kv_cache_dtype` name."""
    return torch.float8_e4m3fn if kv_cache_dtype == "fp8_e4m3" else getattr(torch, kv_cache_dtype)


def check_float8_kv_attention(kv: torch.dtype, attention: str, device: torch.device) -> None:
    """A float8 pool under the Triton attention (`attention`: the backend "auto" resolved):
    its kernels cast to and from e4m3 (Triton's fp8e4nv), which Triton compiles for compute
    capability 8.9 and later only, and which its interpreter (Triton kernels on the CPU)
    rounds wrongly. The torch attention serves a float8 pool on any device."""
    if kv.itemsize != 1 or attention != "triton":
        return
    use = "use attention_backend='torch' or kv_cache_dtype='auto'"
    if device.type != "cuda":
        raise InvalidConfigError(
            f"kv_cache_dtype='fp8_e4m3' with the Triton attention on {device}: Triton's "
            f"interpreter rounds float8 stores wrongly; {use}")
    require_float8_gpu(device, "kv_cache_dtype='fp8_e4m3' with the Triton attention",
                       "Triton's float8 e4m3",
                       f"{use} (the torch attention decodes without CUDA graphs)")


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def _process_memory() -> tuple[int, int]:
    """(resident bytes now, peak resident bytes) of this process; 0 for what is unknown here
    (no `resource` module on Windows; no /proc, so no current figure, on macOS)."""
    try:
        import resource
    except ImportError:
        return 0, 0
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return 0, peak
    return rss, max(peak, rss)  # (the kernel updates ru_maxrss lazily)


def resolve_sizes(config: EngineConfig, *, device_type: str, available_bytes: int,
                  model_context_length: int, kv_bytes_per_token: int) -> EngineConfig:
    """The pool, batch and chunk sizes left "auto" (None), from the device and the model.
    Pure: the facts come in as arguments (tests run it without a GPU)."""
    cuda = device_type == "cuda"
    context_length = min(config.context_length or model_context_length, model_context_length)
    max_total = config.max_total_tokens
    if max_total is None:
        frac = config.mem_fraction_static or (GPU_MEM_FRACTION if cuda else CPU_MEM_FRACTION)
        budget = int(available_bytes * frac)
        if not cuda:
            budget = min(budget, CPU_KV_BYTES_CAP)
        max_total = max(budget // kv_bytes_per_token, 256)
    max_running = min(config.max_running_requests or (256 if cuda else CPU_MAX_RUNNING), max_total)
    chunk = config.chunked_prefill_size or (8192 if cuda else 512)
    if chunk == -1:
        chunk = context_length  # chunking off: a whole prompt per step
    max_prefill = max(config.max_prefill_tokens or 0, chunk + max_running)
    return config.replace(max_total_tokens=max_total, max_running_requests=max_running,
                          chunked_prefill_size=chunk, max_prefill_tokens=max_prefill,
                          context_length=context_length)


class Runtime:
    """Every part of one engine, built from an EngineConfig, and the services sgl.Engine uses."""

    def __init__(self, config: EngineConfig) -> None:
        t0 = time.monotonic()
        asked_gguf = config.quantization == "gguf"  # ("auto" may resolve to it: no error)
        config = resolve_device(config)
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.kv_dtype = kv_dtype(config.kv_cache_dtype)
        torch.manual_seed(config.random_seed)
        if self.device.type == "cpu" and config.num_threads:
            torch.set_num_threads(config.num_threads)
        # Hub ids -> local paths for loading only: the config (and the server's model_path) keep
        # the name the user gave (backend/model_source.py).
        source = resolve_model_source(config)
        if asked_gguf:
            require_gguf_model(source)
        check_activation_quantization(source)
        model = self._load_model(source)
        if config.context_length and config.context_length > self.model_config.context_length:
            logger.warning("context_length %d exceeds the model's %d; using the model's",
                           config.context_length, self.model_config.context_length)
        self.config = config = resolve_sizes(
            config, device_type=self.device.type, available_bytes=_available_bytes(self.device),
            model_context_length=self.model_config.context_length,
            kv_bytes_per_token=self.model_config.kv_bytes_per_token(self.kv_dtype))
        self.context_length = config.context_length
        self._build_engine(config, model)
        self.load_seconds = time.monotonic() - t0
        gc_freeze.hold()  # the loaded engine's objects out of the collector's full passes
        self._frozen = True
        from sgl.backend.model_loader import release_free_heap

        release_free_heap()

    def _load_model(self, config: EngineConfig) -> Any:
        """The model on the engine's kernel set (resolved once, here), its config, and the
        tokenizer."""
        from sgl.backend.kernels.dispatch import resolve_kernels
        from sgl.backend.model_loader import PRESETS, load_model, resolve_model_path
        from sgl.backend.tokenizer import load_tokenizer

        self.kernels = resolve_kernels(  # before the slow load
            config.kernels, self.device, self.dtype,
            batch_invariant=config.enable_deterministic_inference)
        attention = config.attention_backend
        check_float8_kv_attention(self.kv_dtype, self.kernels.attention if attention == "auto"
                                  else attention, self.device)
        check_fp8_device(config.quantization, self.device)
        model, self.model_config = load_model(
            config.model, device=self.device, dtype=self.dtype, load_format=config.load_format,
            model_config=config.model_config, seed=config.random_seed, cache=config.cache_dir,
            quantization=config.quantization)
        if config.activation_quantization == "int8":  # (before use_kernels reads the weights)
            from sgl.backend.quant.cpu_int8 import use_int8_activations

            use_int8_activations(model)
        if config.activation_quantization == "fp8":
            from sgl.backend.quant.fp8 import use_fp8_activations

            use_fp8_activations(model)
        if config.enable_deterministic_inference and self.device.type == "cpu":
            _keep_rows_invariant(model)
        model.use_kernels(self.kernels)  # CPU: packs the linears for oneDNN in "auto" mode
        from sgl.backend.quant.install import weight_bytes

        self.weights_bytes = weight_bytes(model)
        dummy = config.load_format == "dummy" or (config.load_format == "auto" and (
            config.model in PRESETS or (config.model is None and config.model_config)))
        self.tokenizer = None
        if not dummy:
            path, override = resolve_model_path(config.model, config.cache_dir), config.tokenizer
            self.tokenizer = load_tokenizer(path, override, config.cache_dir)
        elif config.tokenizer:
            path = resolve_model_path(config.tokenizer, config.cache_dir)
            self.tokenizer = load_tokenizer(path, None, config.cache_dir)
        return model

    def _build_engine(self, config: EngineConfig, model: Any) -> None:
        from sgl.backend.engine_loop import EngineCore
        from sgl.backend.kv_manager import KVManager
        from sgl.backend.kv_pool import KVPool, ReqToTokenPool
        from sgl.backend.model_runner import ModelRunner
        from sgl.backend.prefix_cache import NoPrefixCache
        from sgl.backend.radix_cache import RadixCache
        from sgl.backend.sampler import Sampler
        from sgl.backend.scheduler import Scheduler, SchedulerConfig

        mcfg, max_running = self.model_config, config.max_running_requests
        self.kv_pool = KVPool(config.max_total_tokens, mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim,
                              self.kv_dtype, self.device, page_size=config.page_size)
        self.req_pool = ReqToTokenPool(max_running, config.context_length + config.page_size, self.device)
        allocator = self.kv_pool.allocator
        self.tree = (NoPrefixCache(allocator) if config.disable_radix_cache
                     else RadixCache(allocator, config.page_size))
        attn = self._attention_backend(config, self.device, self.kv_pool.num_slots)
        overlap = not config.disable_overlap_schedule
        self.sampler = Sampler(vocab_size=mcfg.vocab_size, max_rows=max_running + 1, device=self.device,
                               seed=config.random_seed, eos_token_ids=mcfg.eos_token_ids,
                               token_vocab_size=len(self.tokenizer) if self.tokenizer is not None else None,
                               apply_token_bitmask=self.kernels.apply_token_bitmask,
                               argmax=self.kernels.argmax)
        self.runner = ModelRunner(model, self.kv_pool, self.req_pool, attn, self.sampler, device=self.device,
                                  max_batch=max_running, vocab_size=mcfg.vocab_size, overlap=overlap)
        self.runner.verify_table = config.debug_integrity
        self.runner.decode_rows_past_prompts = config.enable_deterministic_inference
        self.cuda_graph_sizes: list[int] = []
        if self.device.type == "cuda":
            from sgl.backend.quant.linear import prepare_cuda_kernels

            prepare_cuda_kernels(model, self.device, self.dtype)
            if not config.disable_cuda_graph:
                self._capture_cuda_graphs(config, attn, max_running)
        self.scheduler = Scheduler(
            SchedulerConfig(max_running_requests=max_running, chunked_prefill_size=config.chunked_prefill_size,
                            max_prefill_tokens=config.max_prefill_tokens, page_size=config.page_size,
                            policy=config.schedule_policy, conservativeness=config.schedule_conservativeness,
                            context_length=config.context_length, eos_token_ids=frozenset(mcfg.eos_token_ids),
                            max_step_rows=self.cuda_graph_sizes[-1] if self.cuda_graph_sizes else 0,
                            mix_decode_with_prefill=not (config.enable_deterministic_inference
                                                         and self.device.type == "cuda")),
            KVManager(allocator, self.req_pool, self.tree, config.page_size), self.tree,
            self.runner.futures, self.tokenizer, drafter=_drafter(config, self.tokenizer),
        )  # fmt: skip
        self._grammar: GrammarBackend | None = None
        self._grammar_lock = threading.Lock()
        self._ids = itertools.count()
        self.core = EngineCore(self.scheduler, self.runner, overlap=overlap,
                               integrity_check=self._check_integrity if config.debug_integrity else None)

    def _capture_cuda_graphs(self, config: EngineConfig, attn: Any, max_running: int) -> None:
        from sgl.backend.attention.triton_backend import TritonAttentionBackend

        if not isinstance(attn, TritonAttentionBackend):
            logger.warning("CUDA graphs need attention_backend='triton'; decoding eagerly")
            return
        max_bs = min(config.cuda_graph_max_bs or max_running, max_running)
        # A graph row is one token: twice the largest decode batch in rows, so a full batch where
        # requests jump or verify drafts still replays a graph.
        self.runner.capture_cuda_graphs(GRAPH_ROWS_PER_REQ * max_bs)
        self.cuda_graph_sizes = list(self.runner.graphs.sizes)

    def _attention_backend(self, config: EngineConfig, device: torch.device, pool_slots: int):
        name = config.attention_backend
        if name == "auto":
            name = self.kernels.attention
        if name == "triton":
            from sgl.backend.attention.triton_backend import TritonAttentionBackend

            if self.kernels.attention != "triton":
                raise InvalidConfigError(
                    f"attention_backend='triton' needs the Triton kernels, but the kernel set "
                    f"on {device} is {self.kernels.mode!r} without them: use "
                    f"attention_backend='auto' or 'torch', or kernels (SGL_KERNELS) 'triton'")
            return TritonAttentionBackend(self.kernels)
        from sgl.backend.attention.torch_backend import TorchAttentionBackend

        # On the CPU in "auto" mode under a float32 model, decode attention reads the pool in
        # place (cpu_ops.c); elsewhere on the CPU, decode keys persist between steps in a
        # stage as large as the pool at most.
        cpu = device.type == "cpu"
        return TorchAttentionBackend(
            stage_positions=pool_slots if cpu else 0, model_dtype=self.dtype,
            fused_cpu=cpu and self.kernels.mode == "auto" and self.dtype == torch.float32)

    # -- services for the facade -------------------------------------------------------------

    def submit(self, spec: RequestSpec) -> str:
        """Queue one prompt's samples; returns the request id that `abort` takes. Every policy
        default is applied here: per-sample seeds, jump-forward, the deadline."""
        rid = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        timeout = spec.timeout if spec.timeout is not None else self.config.request_timeout
        deadline = time.monotonic() + timeout if timeout is not None else None
        jump = spec.params.jump_forward
        jump = (not self.config.disable_jump_forward) if jump is None else jump
        jump = jump and spec.constraint is not None
        reqs = []
        for i, sink in enumerate(spec.sinks):
            params = spec.params
            if params.seed is not None and params.n > 1:
                params = params.replace(seed=params.seed + i)
            state = self.grammar.new_state(spec.constraint) if spec.constraint is not None else None
            reqs.append(Req(rid=rid, prompt_ids=list(spec.prompt_ids), params=params, logprob=spec.logprob,
                            stream=spec.stream, deadline=deadline, sink=sink, constraint=state,
                            jump_forward=jump, sample_index=i))
        self.core.submit(reqs)
        return rid

    def problem(self) -> str | None:
        """Why the engine thread cannot serve, or None when it is running."""
        if self.core.alive:
            return None
        cause = self.core.fatal_error
        return "the engine thread stopped" + (f" after a crash: {cause!r}" if cause is not None else "")

    def abort(self, rid: str, reason: str) -> None:
        self.core.abort(rid, reason)

    async def compile_constraint(self, kind: str, source: str) -> Any:
        """Compile on the grammar workers without blocking the caller's event loop (the first
        call also builds the backend's tokenizer tables, ~0.3 s, in a thread)."""
        grammar = await asyncio.get_running_loop().run_in_executor(None, lambda: self.grammar)
        return await grammar.compile_async(kind, source, timeout=self.config.grammar_compile_timeout)

    @property
    def grammar(self) -> GrammarBackend:
        """The xgrammar adapter, built once on first use (compiling the tokenizer info ~1 s)."""
        with self._grammar_lock:
            return self._build_grammar()

    def _build_grammar(self) -> GrammarBackend:
        if self._grammar is None:
            from sgl.backend.grammar import GrammarBackend

            self._grammar = GrammarBackend(self.tokenizer, self.model_config.vocab_size,
                                           stop_token_ids=self.model_config.eos_token_ids,
                                           **GrammarBackend.config_options(self.config))
            self.runner.grammar = self._grammar
        return self._grammar

    def check_integrity(self) -> None:
        """Every slot is free, cached in the tree, or owned by exactly one running request
        (checked on the engine thread, between steps)."""
        self.core.call(self._check_integrity)

    def _check_integrity(self) -> None:
        from sgl.backend.kv_pool import check_kv_integrity

        check_kv_integrity(self.kv_pool.allocator, self.tree, self.scheduler.owned_slots())

    def flush_cache(self) -> bool:
        def flush() -> bool:
            if self.scheduler.running:
                return False
            self.tree.reset()
            if self._grammar is not None:
                self._grammar.clear_cache()
            return True

        return self.core.call(flush)

    def stats(self) -> dict[str, Any]:
        p = self.scheduler.counters
        now = time.monotonic()
        window = [(t, n) for t, n in p.recent if now - t < 10.0]
        span = (now - window[0][0]) if window else 0.0
        total = self.kv_pool.allocator.capacity
        return dict(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_used_tokens=total - self.kv_pool.allocator.available_size(),
            kv_total_tokens=total,
            kv_cached_tokens=self.tree.total_size(),
            cache_hit_rate=(p.cached_tokens / p.prompt_tokens) if p.prompt_tokens else 0.0,
            prompt_tokens=p.prompt_tokens,
            cached_tokens=p.cached_tokens,
            output_tokens=p.output_tokens,
            finished_requests=p.finished_requests,
            retractions=p.retractions,
            jump_forward_tokens=p.jump_forward_tokens,
            **_spec_stats(self.scheduler.drafter),
            steps=self.core.num_steps,
            tokens_per_s=(sum(n for _, n in window) / span) if span > 0 else 0.0,
            **self._memory_stats(total - self.kv_pool.allocator.available_size()),
        )

    def _memory_stats(self, kv_used_tokens: int) -> dict[str, int]:
        pool = self.kv_pool
        stage = getattr(self.runner.attn_backend, "stage", None)
        stage_bytes = sum(t.numel() * t.element_size() for t in stage.k + stage.v) if stage else 0
        rss, peak = _process_memory()
        return dict(weights_bytes=self.weights_bytes, kv_bytes_reserved=pool.reserved_bytes,
                    kv_bytes_touched=pool.touched_bytes,
                    kv_bytes_used=kv_used_tokens * pool.bytes_per_slot,
                    kv_bytes_per_token=pool.bytes_per_slot,
                    decode_stage_bytes=stage_bytes, rss_bytes=rss, peak_rss_bytes=peak)

    def close(self) -> None:
        self.core.shutdown()
        if self._grammar is not None:
            self._grammar.close()  # its mask-fill thread (after the engine thread stopped)
        if self._frozen:
            self._frozen = False
            gc_freeze.release()


GRAPH_ROWS_PER_REQ = 2  # decode graphs hold up to 2 x cuda_graph_max_bs token rows


def _keep_rows_invariant(model: Any) -> None:
    """CPU, `enable_deterministic_inference`: every product on the C kernel (quant/linear.py).
    A float weight left (a model folder under quantization "auto") has no such kernel."""
    from sgl.backend.layers.linear import Linear
    from sgl.backend.quant.linear import keep_rows_invariant

    plain = [name for name, m in model.named_modules()
             if isinstance(m, Linear) and m.weight is not None]
    if plain:
        raise InvalidConfigError(
            f"enable_deterministic_inference on the CPU needs GGUF-quantized weights, but "
            f"{len(plain)} layers (e.g. {plain[0]}) hold float weights: use a .gguf model")
    keep_rows_invariant(model)


def _drafter(config: EngineConfig, tokenizer: Any) -> NgramDrafter | None:
    """The n-gram drafter: text-level lookup (spec_text.py) when the tokenizer's pieces
    reproduce its text, else (or when asked) token-id lookup alone."""
    if config.speculative_algorithm is None:
        return None
    spec = SpecConfig(num_draft_tokens=config.speculative_num_draft_tokens,
                      min_window=config.speculative_ngram_min_match_window_size,
                      max_window=config.speculative_ngram_max_match_window_size,
                      disable_by_batch_size=config.speculative_disable_by_batch_size)
    table = PieceTable.from_tokenizer(tokenizer) if config.speculative_ngram_match == "text" else None
    if table is None:
        if config.speculative_ngram_match == "text" and tokenizer is not None:
            logger.warning("speculative_ngram_match='text': the tokenizer's pieces do not spell its "
                           "text; drafting by token-id lookup instead")
        return NgramDrafter(spec)
    return TextDrafter(spec, table)  # its match lengths count bytes: spec_text.py's constants


def _spec_stats(drafter: NgramDrafter | None) -> dict[str, int]:
    st = drafter.stats if drafter is not None else None
    return dict(spec_verify_steps=st.steps if st else 0, spec_draft_tokens=st.proposed if st else 0,
                spec_accepted_tokens=st.accepted if st else 0)
