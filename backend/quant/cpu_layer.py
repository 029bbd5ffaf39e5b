"""The CPU decode step of a quantized Llama-family model in one C call (cpu_layer.c).

    decoder = CpuDecodeStep.build(model)     # None when the model does not qualify
    hidden = decoder.run(x, fb)              # None when this step does not qualify

On the CPU a one-row decode step of a small model spends about a third of its time in the
Python between the kernels: module calls, views, ~12 ctypes calls per layer and their checks
(SmolLM2-135M: ~10 ms of ~32 ms per token). Here the whole stack (every decoder layer, then
the final norm) is one ctypes call per step: the layers' weights, norms and pool buffers are
described once, as an array of C structs, and a step passes its inputs' pointers.

It runs the same C functions the op-by-op CPU path calls, in the same order, so hidden states
and KV are bitwise equal to that path (tests/test_cpu_layer.py). Where it does not qualify,
the model's op path runs instead, unchanged:

- the model (checked once by `build`): float32, every projection a `QuantizedWeight` in the
  CPU kernel's plain layout, no per-head q/k norm (Qwen3 takes the op path), one eps;
- the step (checked by `run`): a DECODE batch of at most `MAX_ROWS` rows on the torch attention
  backend's fused CPU path (a float32, float16 or bfloat16 pool, int32 table), the C
  library loaded.

The scratch (~35 KB per row for SmolLM2) is allocated once per model for `MAX_ROWS` rows.
One step at a time per model: the engine's forward passes are serialized.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import torch

from sgl.backend.attention.torch_backend import TorchAttentionBackend
from sgl.backend.forward_batch import ForwardBatch, ForwardMode
from sgl.backend.quant import cpu_kernel, cpu_ops
from sgl.backend.quant.cpu_threads import ThreadChoice
from sgl.backend.quant.linear import GEMV_MAX_ROWS
from sgl.backend.quant.weight import QuantizedWeight

__all__ = ["MAX_ROWS", "CpuDecodeStep"]

# Rows the one-call step takes (runtime.CPU_MAX_RUNNING, a CPU engine's default cap on running
# requests, is this; a larger decode step runs the op path): the op path's quantized linear
# runs the same C kernel on them, so both give the same bits.
MAX_ROWS = 64
assert MAX_ROWS <= GEMV_MAX_ROWS

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class _QWeight(ctypes.Structure):
    _fields_ = [("bits", _I64), ("group_size", _I64), ("in_features", _I64),
                ("out_features", _I64), ("codes", _P), ("scale", _P), ("zero", _P), ("bias", _P),
                ("int8", _I64), ("f16", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _QWeight), ("o", _QWeight), ("gate_up", _QWeight), ("down", _QWeight),
                ("input_norm", _P), ("post_norm", _P), ("k_cache", _P), ("v_cache", _P)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _I64), ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64),
                ("head_dim", _I64), ("inter", _I64), ("rope_half", _I64), ("eps", _F),
                ("attn_scale", _F), ("kv_kind", _I64), ("rope_cache", _P), ("final_norm", _P),
                ("layers", ctypes.POINTER(_Layer))]


def declare(lib: ctypes.CDLL) -> None:
    """Set the C signatures (called once by cpu_kernel when the library loads)."""
    lib.sgl_decode_scratch_floats.argtypes = [ctypes.POINTER(_Model), _I64]
    lib.sgl_decode_scratch_floats.restype = _I64
    lib.sgl_decode_step.argtypes = [ctypes.POINTER(_Model), _I64, _P, _P, _P, _P, _P, _P, _I64,
                                    _P, _P, _P, _INT]
    lib.sgl_decode_step.restype = _INT


def _qweight(linear: Any) -> _QWeight | None:
    """The C view of a Linear's quantized weight (None: not in the CPU kernel's layout)."""
    w = getattr(linear, "qweight", None)
    bias = linear.bias
    if not isinstance(w, QuantizedWeight) or w.super_groups or w.codes.device.type != "cpu":
        return None
    if bias is not None and not (bias.dtype == torch.float32 and bias.is_contiguous()):
        return None
    return _QWeight(w.bits, w.group_size, w.in_features, w.out_features, w.codes.data_ptr(),
                    w.scale.data_ptr(), w.zero.data_ptr(),
                    None if bias is None else bias.data_ptr(), int(w.int8_activations),
                    int(w.f16_scales))


def _f32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
               for t in tensors)


class CpuDecodeStep:
    """Every layer of one model as C structs, plus the step's scratch (module docstring)."""

    def __init__(self, model: Any, layers: list[_Layer], desc: _Model,
                 pointees: list[Any]) -> None:
        # Every tensor the structs point into, held here: a weight replaced in the model later
        # (which the step would not see: build once, after loading) is never freed under it.
        self._pointees = pointees
        self._layers = (_Layer * len(layers))(*layers)
        desc.layers = ctypes.cast(self._layers, ctypes.POINTER(_Layer))
        self._desc = desc
        self._desc_ref = ctypes.byref(desc)
        self._pool_key: tuple[int, int] | None = None  # (id, first buffer) of the pool in _layers
        self._pool: Any = None  # the pool whose buffers _layers points into (kept alive)
        # Bound at the first step, not at build: the library may still be compiling then
        # (cpu_kernel.start_build), and the engine's load should not wait for it.
        self._lib: ctypes.CDLL | None = None
        self._scratch = self._residual = torch.empty(0)
        self.thread_choice = ThreadChoice()  # one thread or torch's count, by timing both
        self.head_choice = ThreadChoice()  # the same for the LM head after it (project_head)

    def _bind_library(self) -> bool:
        if self._lib is None:
            lib = cpu_kernel._library()
            if lib is None:
                return False
            floats = lib.sgl_decode_scratch_floats(self._desc_ref, MAX_ROWS)
            self._scratch = torch.empty(floats, dtype=torch.float32)
            self._residual = torch.empty(MAX_ROWS, self._desc.hidden, dtype=torch.float32)
            self._lib = lib
        return True

    @classmethod
    def build(cls, model: Any) -> CpuDecodeStep | None:
        """For a LlamaModel (models/llama.py) whose every projection is quantized in the CPU
        kernel's layout; None when it does not qualify or the library is missing."""
        layers = list(model.layers)
        if not layers or not cpu_kernel.likely_available():
            return None
        first = layers[0].self_attn
        norms = [model.norm] + [n for layer in layers
                                for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        cache = model.rotary.cos_sin.view(model.rotary.cos_sin.shape[0], -1)  # [P, head_dim]
        if (any(layer.self_attn.q_norm is not None for layer in layers)
                or len({n.eps for n in norms}) != 1
                or not _f32(cache, *(n.weight for n in norms))):
            return None
        structs = []
        pointees: list[Any] = [cache, *(n.weight for n in norms)]
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            weights = [_qweight(m) for m in projections]
            if any(w is None for w in weights):
                return None
            pointees += [(m.qweight, m.bias) for m in projections]
            structs.append(_Layer(*weights, layer.input_layernorm.weight.data_ptr(),
                                  layer.post_attention_layernorm.weight.data_ptr(), None, None))
        inter = layers[0].mlp.gate_up_proj.out_features // 2
        desc = _Model(len(layers), norms[0].weight.shape[0], first.num_heads, first.num_kv_heads,
                      first.head_dim, inter, cache.shape[-1] // 2, norms[0].eps, first.scale,
                      0, cache.data_ptr(), model.norm.weight.data_ptr(), None)
        return cls(model, structs, desc, pointees)

    def _bind_pool(self, pool: Any) -> bool:
        """Point the layer structs at `pool`'s buffers (once per pool); False when the pool is
        not [slots, kv_heads, head_dim] on the CPU in a dtype the C ops take."""
        key = (id(pool), pool.k_buffer[0].data_ptr())
        if key == self._pool_key:
            return True
        desc, buffers = self._desc, (*pool.k_buffer, *pool.v_buffer)
        dtype = pool.k_buffer[0].dtype
        if (len(pool.k_buffer) != desc.num_layers or not cpu_ops.kv_dtype_supported(dtype)
                or not all(b.dtype == dtype and b.is_cpu and b.is_contiguous() for b in buffers)
                or pool.k_buffer[0].shape[1:] != (desc.kv_heads, desc.head_dim)):
            return False
        desc.kv_kind = cpu_ops.kv_kind(dtype)
        for layer, k, v in zip(self._layers, pool.k_buffer, pool.v_buffer):
            layer.k_cache, layer.v_cache = k.data_ptr(), v.data_ptr()
        self._pool_key, self._pool = key, pool
        return True

    def project_head(self, head: Any, hidden: torch.Tensor) -> torch.Tensor:
        """`head.project(hidden, threads)` (the model's LM head, an Embedding) on the count its
        own ThreadChoice picks: a head of a quantized table is one C call of ~50k features,
        whose best count under load need not be the step's (measured on the loaded VM: 8 ms
        on two threads against 3.5 on one, while at other times two were faster)."""
        threads = self.head_choice.threads(torch.get_num_threads())
        start = time.perf_counter()
        logits = head.project(hidden, threads)
        self.head_choice.record(threads, time.perf_counter() - start)
        return logits

    def run(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor | None:
        """x [T, hidden] (the embeddings) -> the final-normed hidden states [T, hidden], with
        every layer's K/V stored; None (nothing done) when this step does not qualify."""
        tokens = x.shape[0]
        backend = fb.attn_backend
        if not (fb.mode is ForwardMode.DECODE and 0 < tokens <= MAX_ROWS
                and isinstance(backend, TorchAttentionBackend) and _f32(x)):
            return None
        rows = backend.fused_decode_rows(fb)
        if rows is None or not self._bind_library() or not self._bind_pool(fb.kv_pool):
            return None
        table_rows, lens = rows
        positions, loc = fb.positions, fb.out_cache_loc
        if not all(t.dtype == torch.int64 and t.is_contiguous() and t.numel() == tokens
                   for t in (positions, loc, table_rows, lens)):
            return None
        out = torch.empty(tokens, self._desc.hidden, dtype=torch.float32)
        assert self._lib is not None
        threads = self.thread_choice.threads(torch.get_num_threads())
        start = time.perf_counter()
        failed = self._lib.sgl_decode_step(
            self._desc_ref, tokens, x.data_ptr(), self._residual.data_ptr(), out.data_ptr(),
            positions.data_ptr(), loc.data_ptr(), fb.req_to_token.data_ptr(),
            fb.req_to_token.stride(0), table_rows.data_ptr(), lens.data_ptr(),
            self._scratch.data_ptr(), threads)
        self.thread_choice.record(threads, time.perf_counter() - start)
        if failed:
            raise MemoryError("decode step: attention could not allocate its work buffer")
        return out
