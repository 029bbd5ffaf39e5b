"""A CPU engine stays lean: what it imports, and the memory its KV takes.

Triton is the GPU's kernel language; on the CPU every op runs its pure-torch reference or the
C ops, so importing Triton there is ~0.2 s of start-up and ~70 MB of resident memory for
nothing (kernels/dispatch.py imports the `triton_<op>` modules only when it picks them).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

# Build the default engine (the quantized GGUF model) on the CPU, generate, and report which
# heavy GPU-only modules got imported on the way.
_CPU_ENGINE_CHILD = """
import sys
import sgl

with sgl.Engine(device="cpu", max_total_tokens=2048) as engine:
    out = engine.generate_sync("Hello", max_new_tokens=4, temperature=0)
    assert len(out.token_ids) == 4, out
print(sorted(m for m in ("triton", "triton.language") if m in sys.modules))
"""


@pytest.mark.slow
def test_cpu_engine_never_imports_triton() -> None:
    proc = subprocess.run([sys.executable, "-c", _CPU_ENGINE_CHILD], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_reference_kernel_modules_do_not_import_triton() -> None:
    # The references and the kernel set's CPU resolution, in a fresh interpreter.
    code = (
        "import sys, torch\n"
        "from sgl.backend.kernels import dispatch\n"
        "from sgl.backend.attention import torch_backend\n"
        "from sgl.backend.quant import linear\n"
        "ks = dispatch.resolve_kernels('auto', 'cpu', torch.float32)\n"
        "ks = dispatch.resolve_kernels('reference', 'cpu', torch.bfloat16)\n"
        "assert not linear.use_triton(torch.zeros(1))\n"
        "print('triton' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "False"


# -- 16- and 8-bit KV cache (kv_cache_dtype) ---------------------------------------------------


def test_kv_cache_dtype_accepts_sglangs_names_and_refuses_the_rest() -> None:
    import sgl
    from sgl.config import EngineConfig

    for value in ("auto", "bfloat16", "bf16", "float16", "float32", "fp8_e4m3", "fp8"):
        assert EngineConfig(kv_cache_dtype=value).kv_cache_dtype == value
    with pytest.raises(sgl.InvalidConfigError, match="kv_cache_dtype='fp8_e5m2': sgl keeps no KV"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(sgl.InvalidConfigError, match="kv_cache_dtype='half': must be one of"):
        EngineConfig(kv_cache_dtype="half")


def test_kv_cache_dtype_resolves_per_device() -> None:
    import sgl
    import torch

    from sgl.backend.runtime import CPU_AUTO_KV_CACHE_DTYPE, kv_dtype, resolve_kv_cache_dtype

    assert resolve_kv_cache_dtype("auto", "cpu", "float32") == CPU_AUTO_KV_CACHE_DTYPE
    assert resolve_kv_cache_dtype("auto", "cpu", "bfloat16") == "bfloat16"  # the model's
    assert resolve_kv_cache_dtype("bf16", "cpu", "float32") == "bfloat16"
    assert resolve_kv_cache_dtype("float32", "cpu", "float32") == "float32"
    assert resolve_kv_cache_dtype("fp8", "cpu", "float32") == "fp8_e4m3"  # vLLM's name
    assert kv_dtype(resolve_kv_cache_dtype("fp8_e4m3", "cpu", "float32")) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("auto", "cuda", "bfloat16") == "bfloat16"
    assert resolve_kv_cache_dtype("bf16", "cuda:1", "bfloat16") == "bfloat16"
    # CUDA: the model's dtype or float8 (the Triton kernels round into it and widen from it)
    for model_dtype in ("bfloat16", "float32"):
        for fp8 in ("fp8_e4m3", "fp8"):
            assert resolve_kv_cache_dtype(fp8, "cuda", model_dtype) == "fp8_e4m3"
    for model_dtype, other in (("bfloat16", "float16"), ("bfloat16", "float32"),
                               ("float32", "bfloat16")):
        with pytest.raises(sgl.InvalidConfigError,
                           match=f"kv_cache_dtype='{other}': on CUDA the KV cache is kept in the "
                                 f"model's dtype \\({model_dtype}\\) or in float8: use 'auto' "
                                 "or 'fp8_e4m3'"):
            resolve_kv_cache_dtype(other, "cuda", model_dtype)


def test_float8_kv_cache_under_the_triton_attention_needs_an_sm89_gpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import sgl
    import torch

    from sgl.backend.runtime import check_float8_kv_attention

    fp8, cuda = torch.float8_e4m3fn, torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    check_float8_kv_attention(fp8, "triton", cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    with pytest.raises(sgl.InvalidConfigError, match="capability 8.9 or later .* this one is "
                                                     "8.0: use attention_backend='torch'"):
        check_float8_kv_attention(fp8, "triton", cuda)
    check_float8_kv_attention(fp8, "torch", cuda)  # the torch attention: any GPU
    check_float8_kv_attention(torch.bfloat16, "triton", cuda)
    with pytest.raises(sgl.InvalidConfigError, match="interpreter rounds float8 stores wrongly"):
        check_float8_kv_attention(fp8, "triton", torch.device("cpu"))


@pytest.mark.anyio
@pytest.mark.parametrize("kernels", ["auto", "reference"])
async def test_narrower_kv_cache_shrinks_the_pool_and_serves(kernels: str) -> None:
    """A float32 model over a float16 and a float8 e4m3 pool: half and a quarter of the bytes
    per token (stats say so), and the engine decodes a batch on both CPU paths (the fused C
    ops; the stage and SDPA)."""
    import asyncio

    import sgl

    stats = {}
    for kv in ("float32", "float16", "fp8_e4m3"):
        async with sgl.Engine("smollm2-135m", load_format="dummy", device="cpu", kernels=kernels,
                              model_config={"num_hidden_layers": 2, "vocab_size": 512},
                              max_total_tokens=4096, kv_cache_dtype=kv) as engine:
            outs = await asyncio.gather(*(engine.generate(list(range(5, 5 + 9 * i)), temperature=0,
                                                          max_new_tokens=12, ignore_eos=True)
                                          for i in range(1, 5)))
            assert all(len(o.token_ids) == 12 for o in outs)
            engine.check_integrity()
            stats[kv] = engine.stats()
    per_token = 2 * 2 * 3 * 64  # K and V x layers x kv heads x head_dim
    assert stats["float32"].kv_bytes_per_token == 4 * per_token
    assert stats["float16"].kv_bytes_per_token == 2 * per_token
    assert stats["fp8_e4m3"].kv_bytes_per_token == per_token
    assert stats["float16"].kv_bytes_reserved * 2 == stats["float32"].kv_bytes_reserved
