"""The CPU linear kernels on the default model's weights: F.linear and oneDNN on the float32
weights, and the quantized kernel (backend/quant/) on the file's own Q4_1/Q8_0 tensors.

    python bench/cpu_linear.py [--rows 1 4 16 32 512] [--repeats 5]

For each row count M: the time of every linear projection of one forward pass of
SmolLM2-135M (30 layers x qkv, o_proj, gate_up, down, plus the LM head), run over the
model's real weights in layer order, as a step reads them (each weight is touched once per
pass, so caches do not flatter small M). Activations float32. Best of `--repeats` passes per
variant, all variants in the same run. The quantized weights run both of their CPU paths at
every M: the C kernel on the codes and dequantize + BLAS (`quant_linear` takes the first up to
`GEMV_MAX_ROWS` rows: the crossover these columns decide). Prints a table, appends one JSON
line to bench/results/cpu_linear.jsonl.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record, table  # noqa: E402

from sgl.backend.kernels import onednn_linear  # noqa: E402
from sgl.backend.model_loader import load_model  # noqa: E402
from sgl.backend.quant import cpu_kernel, linear  # noqa: E402

MODEL = "SmolLM2-135M-Instruct (Q4_1 GGUF; float32 = dequantized)"


def projections(model: torch.nn.Module, attr: str = "weight") -> list:
    """Every linear weight [N, K] of one forward pass, in the order a step reads them
    (`attr` "qweight": the QuantizedWeights of a model loaded quantized)."""
    layers = []
    for layer in model.model.layers:
        layers += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj]
    weights = [getattr(m, attr) for m in [*layers, model.lm_head]]
    return [w.detach() if isinstance(w, torch.Tensor) else w for w in weights]


def best_pass_ms(fn, inputs: list[torch.Tensor], weights: list, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms up
        t = time.perf_counter()
        for x, w in zip(inputs, weights):
            fn(x, w)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256, 512])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model, _ = load_model(None, device=torch.device("cpu"), dtype=torch.float32)
    plain = projections(model)
    packed = [onednn_linear.pack(w) for w in plain]
    quantized_model, _ = load_model(None, device=torch.device("cpu"), dtype=torch.float32,
                                    quantization="gguf")
    quantized = projections(quantized_model, "qweight")
    rows, figures = [], {}
    for m in args.rows:
        inputs = [torch.randn(m, w.shape[1]) for w in plain]
        ref = best_pass_ms(F.linear, inputs, plain, args.repeats)
        ours = best_pass_ms(onednn_linear.packed_linear, inputs, packed, args.repeats)
        kernel = best_pass_ms(lambda x, w: cpu_kernel.qlinear(x, w, None), inputs, quantized,
                              args.repeats)
        blas = best_pass_ms(lambda x, w: linear._tiled_linear(x, w, None), inputs, quantized,
                            args.repeats)
        rows.append({"rows": m, "F.linear ms": ref, "packed oneDNN ms": ours,
                     "quantized C kernel ms": kernel, "quantized dequantize+BLAS ms": blas,
                     "C / dequantize+BLAS": kernel / blas})
        figures[f"rows {m}"] = {"F.linear ms": ref, "packed ms": ours, "C kernel ms": kernel,
                                "dequantize+BLAS ms": blas}
    print(table(rows, ["rows", "F.linear ms", "packed oneDNN ms", "quantized C kernel ms",
                       "quantized dequantize+BLAS ms", "C / dequantize+BLAS"]))
    record("cpu_linear", MODEL, "all linear projections of one forward pass, float32 activations",
           figures)


if __name__ == "__main__":
    main()
