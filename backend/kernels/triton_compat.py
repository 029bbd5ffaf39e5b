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

    UPCAST: cast the operands to fp32 first. Set only under the interpreter, whose `tl.dot`
    multiplies the raw bit patterns of bf16 operands (seen in triton 3.9); on a GPU the
    operands stay bf16 and hit the tensor cores.
    IEEE: exact fp32 products instead of TF32, for fp32 models that must match the CPU path.
    """
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
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


__all__ = ["HAS_TRITON", "triton", "tl", "mma", "next_power_of_2", "cdiv", "is_interpreted"]
