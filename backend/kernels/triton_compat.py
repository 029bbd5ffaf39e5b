"""Import Triton when it is installed; otherwise stand-ins so the kernel modules still import.

The kernel modules define their `@triton.jit` functions at import time. On a CPU-only install
without the `triton` package (it is an optional dependency) we still want the pure-torch
references in those same modules to work, so `triton.jit` becomes a decorator that returns a
function raising a clear error when called. Nothing here touches the environment: whether
Triton runs compiled or under its interpreter (`TRITON_INTERPRET=1`) is Triton's own decision,
made when each kernel is decorated.
"""

from __future__ import annotations

from typing import Any, Callable

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

    class _MissingTriton:
        """`triton` stand-in: `@triton.jit` works, calling the kernel explains what is missing."""

        @staticmethod
        def jit(fn: Callable[..., Any] | None = None, **_: Any) -> Any:
            def wrap(f: Callable[..., Any]) -> Any:
                def missing(*args: Any, **kwargs: Any) -> Any:
                    raise RuntimeError(f"{f.__name__} needs the `triton` package")

                return _Launchable(missing)

            return wrap(fn) if fn is not None else wrap

    class _Launchable:
        def __init__(self, fn: Callable[..., Any]) -> None:
            self._fn = fn

        def __getitem__(self, grid: Any) -> Callable[..., Any]:
            return self._fn

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self._fn(*args, **kwargs)

    class _MissingLanguage:
        constexpr = object  # only named in (string) annotations

    triton = _MissingTriton()  # type: ignore[assignment]
    tl = _MissingLanguage()  # type: ignore[assignment]


@triton.jit
def mma(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """`tl.dot(a, b)` with fp32 accumulation; the flags keep one kernel source for all runs.

    UPCAST: set only under the interpreter, whose `tl.dot` multiplies the raw bit patterns of
    bf16 operands (seen in triton 3.9): the operands are cast to fp32, and the product is
    summed over K element by element instead of by numpy's matmul, which blocks rows so that
    a row's sums would follow its position in the tile. The tensor cores treat every element
    alike, and the kernels' row invariance (tests/test_deterministic.py) must show in the
    interpreter too. On a GPU the operands stay bf16 and hit the tensor cores.
    IEEE: exact fp32 products instead of TF32, for fp32 models that must match the CPU path.
    """
    if UPCAST:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def is_interpreted(kernel: Any) -> bool:
    """True when `kernel` was decorated while TRITON_INTERPRET=1 (runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


# Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start
# while the kernel before it on the stream is still running, as soon as every program of that
# one has called `let_next_launch` (or exited); it must call `wait_for_inputs` before it reads
# anything the kernel before wrote (or writes anything at all: the memory may be that kernel's
# still). The one-row FP8 GEMVs can launch so (quant/triton_fp8.py): their weights never
# change, so they load the first K step's before waiting, which would hide their start (launch
# and the first DRAM round trip) behind the small kernel before them; that kernel (RMSNorm,
# SiLU x mul, decode attention) lets them launch as it starts (decode attention merging its
# splits in its last program: once every program has finished its loop). The GEMVs let the
# small kernel after them launch in turn: the 4-bit CUDA GEMV as a program starts, the FP8
# ones once their K loop is done (session 25: quant/cuda_gemv.py, quant/triton_fp8.py). Both
# calls are no-ops where nothing is launched so. On by default (`PDL_SWITCH`) since it was
# checked on the H200 (session 10): the same greedy tokens with and without it, in CUDA graphs
# and eagerly (tests/test_quant_gpu.py's early-launch test), and the 8B FP8 single stream
# 326.1 -> 333.0 tok/s (`bench/gpu_bench.py --quant-engines fp8_nopdl,fp8`).
try:  # (triton.language.extra.cuda's grid dependency control: Triton 3.3 and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_PDL = True
except ImportError:  # pragma: no cover - older Triton, or none
    HAS_PDL = False
PDL_SWITCH = [True]  # [0] True: launch the kernels above so, on devices that can
# The small kernels themselves (RMSNorm, rotary and KV store, decode attention, SiLU x mul)
# launch early too when [0] is True (and PDL_SWITCH's): each waits (`wait_for_inputs`) as it
# starts, before it reads or writes anything, so only its launch and start-up overlap the
# kernel before it (a GEMV's last programs, a norm's tail). They also let the next kernel
# start as they begin, so a decode step's kernels are one chain of early launches.
# Transitively safe: a kernel ends only after its wait returned, so when a kernel's wait
# returns every kernel before it on the stream has finished and its writes are visible.
# On since session 24: inside one engine (`bench/gpu_ab.py`, three turns each) the 8B single
# stream read 393.7 -> 414.4 tok/s with Q4 weights (+5.3%) and 343.9 -> 354.0 with FP8 (+3.0%),
# every turn the same way. (Session 21 had read it across two engines, -1.9% and +1.1%, and
# turned it off; two engines of the same code spread ~6%, which hid the gain.)
SMALL_EARLY_SWITCH = [True]
# What a kernel launched early may read before its wait: what nothing on the stream can still be
# writing. That is a parameter (the norm's weight) and the step's inputs: positions, pool
# slots, sequence lengths and the request table are written by torch's copies as the step
# starts, and a kernel launched early starts only once the kernel before lets it, which torch's
# kernels never do; the step's first early kernel thus starts after those copies have finished.
# And the keys and values of earlier steps, which only an L2 prefetch touches before the wait
# (`prefetch_l2`: the new token's row, written by the kernel just before, may be among them,
# and L2 holds the latest bytes whichever comes first). When [0] is True RMSNorm loads its
# weight before its wait (session 24: the 8B Q4 single stream +0.9%), rotary + KV store its
# positions, slots and cos/sin rows, and decode attention its lengths, its first tile's table
# slots and an L2 prefetch of that tile's keys and values (session 25: +1.0-1.3%). A list:
# bench variants turn it off to measure it (read at each launch, so at graph capture).
INPUTS_FIRST = [True]
_PDL_DEVICES: dict[int, bool] = {}


def pdl_launch(device: Any, kernel: Any) -> bool:
    """Whether `kernel` launches on `device` (a torch.device) may use PDL: Hopper or later,
    compiled (not interpreted), Triton with grid dependency control, the switch on."""
    if not (HAS_PDL and PDL_SWITCH[0]) or device.type != "cuda" or is_interpreted(kernel):
        return False
    index = device.index if device.index is not None else -1
    if index not in _PDL_DEVICES:
        import torch

        _PDL_DEVICES[index] = torch.cuda.get_device_capability(device)[0] >= 9
    return _PDL_DEVICES[index]


def launch_options(device: Any, kernel: Any) -> dict[str, Any]:
    """The launch keywords of a small kernel taking the constexprs PDL (lets the next kernel
    start) and WAIT (launched early itself: waits first), with Triton's `launch_pdl`."""
    pdl = pdl_launch(device, kernel)
    wait = pdl and SMALL_EARLY_SWITCH[0]
    return {"PDL": pdl, "WAIT": wait, **({"launch_pdl": True} if wait else {})}


@triton.jit
def let_next_launch(PDL: tl.constexpr):
    """Let the next kernel on the stream start now, if it was launched with PDL (it waits in
    `wait_for_inputs` for this one to finish)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines holding `ptrs` (a tensor of pointers): a hint, nothing
    comes back and nothing waits for it. Compiled kernels only (inline PTX)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Under PDL: wait until the kernel before has finished and its writes are visible."""
    if PDL:
        gdc_wait()


# Counters for "the last program finishes the job": a kernel whose programs each store a
# partial result counts itself in an int32 counter (`arrives_last`: an atomic add,
# acquire-release at GPU scope, after a barrier so that the whole program's stores are released
# with it), and the program that finds all the others arrived reads the partials back and
# finishes; it then puts the counter back to 0, so the next launch finds it so (the split-K
# "last" reductions, quant/triton_split.py and triton_gemm.py; decode attention's merge,
# triton_attention_decode.py; the greedy argmax, triton_argmax.py). One zeroed buffer per
# device and stream: kernels on one stream run one after another (one launched early touches
# the counters only after its wait), so no two launches use a counter at once. A buffer is
# made on first use, which the engine's capture makes during its eager warm-up on the capture
# stream; made inside a capture it is the graph's memory plus a captured zeroing (harmless: it
# is zero then anyway); a buffer outgrown while a graph may hold it is kept alive.
_COUNTERS: dict[tuple[str, int | None, int], Any] = {}  # (device, stream) -> int32 tensor
_RETIRED: list[Any] = []  # replaced buffers: a captured graph may still use one
MIN_COUNTERS = 1 << 16  # first size of a buffer (256 KB): tiles of the largest 8B products


def tile_counters(device: Any, tiles: int) -> Any:
    """A zeroed int32 buffer of at least `tiles` counters for launches on `device`'s (a
    torch.device) current stream; every kernel using it leaves it zeroed."""
    import torch

    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < tiles:
        if buf is not None:
            _RETIRED.append(buf)
        size = max(MIN_COUNTERS, 1 << max(tiles - 1, 1).bit_length())
        buf = _COUNTERS[key] = torch.zeros(size, device=device, dtype=torch.int32)
    return buf


@triton.jit
def arrives_last(counter, count):
    """Count this program in `counter` once all its partial stores are issued (a barrier, then
    an acquire-release atomic at GPU scope); True in the program that completes `count`
    arrivals, which may then read every program's partials (past L1: `.cg`) and must put the
    counter back to 0."""
    tl.debug_barrier()  # all of this program's stores before the release below
    return tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == count - 1


__all__ = ["HAS_PDL", "HAS_TRITON", "INPUTS_FIRST", "MIN_COUNTERS", "PDL_SWITCH",
           "SMALL_EARLY_SWITCH", "triton", "tl", "mma", "next_power_of_2", "cdiv", "arrives_last",
           "is_interpreted", "launch_options", "let_next_launch", "pdl_launch", "prefetch_l2",
           "tile_counters", "wait_for_inputs"]
