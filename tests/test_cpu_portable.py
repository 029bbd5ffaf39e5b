"""The CPU kernels' portable build (quant/cpu_portable.h: the AVX2 intrinsics the kernels use,
written in portable C; what 64-bit ARM compiles) gives the AVX2 build's bits. On x86-64 the
library is built here a second time with SGL_PORTABLE and the two are compared product for
product through the same Python wrappers, and (slow) a whole engine's greedy tokens and
logprobs. Where an aarch64 cross compiler and qemu-aarch64 are installed, the ARM build itself
is compiled, run and compared with the portable build of this machine
(tests/cpu_portable_check.c)."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_quant_kernels import weight

from sgl.backend.quant import FORMATS, cpu_build, cpu_int8, cpu_kernel, cpu_ops

HERE = Path(__file__).parent
pytestmark = pytest.mark.skipif(
    platform.machine() not in cpu_build.X86_MACHINES or cpu_build.compiler() is None
    or not cpu_kernel.available(),
    reason="compares the portable build with the AVX2 one: x86-64 with a compiler and AVX2")


@pytest.fixture(scope="module")
def portable(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The portable library, built and declared as the engine would load it on ARM."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("SGL_CPU_PORTABLE", "1")
        m.setenv("SGL_CACHE_DIR", str(tmp_path_factory.mktemp("portable-cache")))
        m.setattr(cpu_kernel, "_packaged_library", lambda: None)
        lib = cpu_kernel._load()
    assert lib is not None and lib.sgl_portable() == 1 and lib.sgl_cpu_ok() == 1
    return lib


def both(portable: ctypes.CDLL, run: Callable[[], Any]) -> tuple[Any, Any]:
    """run() with the AVX2 library (AVX-512 twins on where the CPU has them), then with the
    portable one in its place."""
    native = run()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(cpu_kernel, "_resolved", [portable])
        ported = run()
    return native, ported


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(-1).view(torch.uint8),
                       b.contiguous().view(-1).view(torch.uint8)), "the portable bits differ"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 5, 9, 33])
def test_quantized_products_and_dequantize(fmt: str, rows: int, portable: ctypes.CDLL) -> None:
    in_features = 96 if FORMATS[fmt][0] == 32 else 512
    w = weight(fmt, 37, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(37)
    (y, d), (y2, d2) = both(portable, lambda: (
        cpu_kernel.qlinear(x, w, bias), cpu_kernel.dequantize(w)))
    assert_same_bits(y, y2)
    assert_same_bits(d, d2)


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_int8_activation_products(rows: int, portable: ctypes.CDLL) -> None:
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    for fmt in ("Q4_0", "Q4_1", "Q8_0", "Q6_K"):
        w = weight(fmt, 33, 512, seed=rows)
        y, y2 = both(portable, lambda w=w: cpu_int8.int8_linear(x, w, None))
        assert_same_bits(y, y2)


def _not_the_library(*args: Any) -> None:
    raise AssertionError("a torch reference ran instead of the library")


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16,
                                      torch.float8_e4m3fn])
def test_decode_ops(kv_dtype: torch.dtype, portable: ctypes.CDLL,
                    monkeypatch: pytest.MonkeyPatch) -> None:
    """RMSNorm (fused with the residual), SiLU-and-multiply, rotary, the KV store and decode
    attention over every pool dtype, on one set of random inputs; the torch references are
    made to fail, so every op runs the library."""
    for name in ("rmsnorm_reference", "fused_add_rmsnorm_reference", "silu_and_mul_reference",
                 "rotary_embedding_reference", "kv_store_reference"):
        monkeypatch.setattr(cpu_ops, name, _not_the_library)
    gen = torch.Generator().manual_seed(7)
    T, heads, kv_heads, D, slots = 5, 9, 3, 64, 300
    hidden = torch.randn(T, 576, generator=gen)
    residual = torch.randn(T, 576, generator=gen)
    norm_w = torch.randn(576, generator=gen)
    gate_up = torch.randn(T, 2 * 1536, generator=gen) * 4
    q = torch.randn(T, heads, D, generator=gen)
    k = torch.randn(T, kv_heads, D, generator=gen)
    v = torch.randn(T, kv_heads, D, generator=gen)
    positions = torch.tensor([0, 7, 100, 1000, 4095])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    cos_sin = torch.cat([torch.outer(torch.arange(4096).float(), inv_freq).cos(),
                         torch.outer(torch.arange(4096).float(), inv_freq).sin()], -1)
    lens = [1, 13, 64, 150, 299]
    table = torch.stack([torch.randperm(slots, generator=gen)[:299].to(torch.int32)
                         for _ in range(T)])
    pool_k = (torch.randn(slots, kv_heads, D, generator=gen)).to(kv_dtype)
    pool_v = (torch.randn(slots, kv_heads, D, generator=gen)).to(kv_dtype)

    def run() -> list[torch.Tensor]:
        out = [cpu_ops.rmsnorm(hidden, norm_w, 1e-5)]
        out += list(cpu_ops.fused_add_rmsnorm(hidden, residual, norm_w, 1e-5))
        out.append(cpu_ops.silu_and_mul(gate_up))
        qq, kk = cpu_ops.rotary_embedding(positions, q.clone(), k.clone(), cos_sin, True)
        out += [qq, kk]
        pk, pv = pool_k.clone(), pool_v.clone()
        cpu_ops.kv_store(pk, pv, kk, v, table[torch.arange(T), torch.tensor(lens) - 1].long())
        out += [pk, pv]
        out.append(cpu_ops.decode_attention(qq, pk, pv, table, torch.arange(T),
                                            torch.tensor(lens), 0.125))
        return out

    for a, b in zip(*both(portable, run)):
        assert_same_bits(a, b)


@pytest.mark.slow
def test_the_engine_gives_the_same_tokens_and_logprobs(tmp_path: Path) -> None:
    """The default model, greedy, through the one-call decode step and every op, once on each
    build (separate processes: the library is chosen at load)."""
    script = HERE / "cpu_portable_engine.py"
    env = dict(os.environ, SGL_CACHE_DIR=str(tmp_path / "cache"))
    native = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                            text=True, check=True)
    ported = subprocess.run([sys.executable, str(script)], env=dict(env, SGL_CPU_PORTABLE="1"),
                            capture_output=True, text=True, check=True)
    a, b = json.loads(native.stdout), json.loads(ported.stdout)
    assert (a["portable"], b["portable"]) == (0, 1)
    assert a["outputs"] == b["outputs"]  # token ids and logprobs, as float reprs


def _arm_tools() -> tuple[str, str] | None:
    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    return (cc, qemu) if cc and qemu else None


@pytest.mark.skipif(_arm_tools() is None, reason="no aarch64 cross compiler or qemu-aarch64")
def test_the_arm_build_gives_the_portable_bits(tmp_path: Path) -> None:
    """tests/cpu_portable_check.c drives the library's entry points on fixed pseudo-random
    inputs and prints a hash of every output: the same line from this machine's portable
    build and from the aarch64 build run under qemu."""
    cc, qemu = _arm_tools()
    outs = []
    for compiler, runner, extra in ((cpu_build.compiler(), [], ["-DSGL_PORTABLE"]),
                                    (cc, [qemu, "-L", "/usr/aarch64-linux-gnu"], [])):
        exe = tmp_path / f"check-{len(outs)}"
        sources = [str(cpu_build.HERE / name) for name in cpu_build.SOURCE_NAMES]
        subprocess.run([compiler, *cpu_build.FLAGS, *extra, f"-I{cpu_build.HERE}", "-o", str(exe),
                        str(HERE / "cpu_portable_check.c"), *sources, "-lm"],
                       check=True, capture_output=True, text=True)
        outs.append(subprocess.run([*runner, str(exe)], check=True, capture_output=True,
                                   text=True).stdout)
    assert outs[0] == outs[1] and outs[0].count("\n") >= 5, outs
