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
