"""The CPU linear kernel (oneDNN on packed weights) vs F.linear, on the default model's weights.

    python bench/cpu_linear.py [--rows 1 4 32 512] [--repeats 5]

For each row count M: the time of every linear projection of one forward pass of
SmolLM2-135M (30 layers x qkv, o_proj, gate_up, down, plus the LM head), float32, run over the
model's real weights in layer order, as a step reads them (each weight is touched once per
pass, so caches do not flatter small M). Best of `--repeats` passes per variant, both variants
in the same run. Prints a table, appends one JSON line to bench/results/cpu_linear.jsonl.
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

MODEL = "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized)"


def projections(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every linear weight [N, K] of one forward pass, in the order a step reads them."""
    weights = []
    for layer in model.model.layers:
        weights += [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight,
                    layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
    return [w.detach() for w in weights] + [model.lm_head.weight.detach()]


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
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32, 512])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model, _ = load_model(None, device=torch.device("cpu"), dtype=torch.float32)
    plain = projections(model)
    packed = [onednn_linear.pack(w) for w in plain]
    rows, figures = [], {}
    for m in args.rows:
        inputs = [torch.randn(m, w.shape[1]) for w in plain]
        ref = best_pass_ms(F.linear, inputs, plain, args.repeats)
        ours = best_pass_ms(onednn_linear.packed_linear, inputs, packed, args.repeats)
        rows.append({"rows": m, "F.linear ms": ref, "packed oneDNN ms": ours, "speed-up": ref / ours})
        figures[f"rows {m}"] = {"F.linear ms": ref, "packed ms": ours}
    print(table(rows, ["rows", "F.linear ms", "packed oneDNN ms", "speed-up"]))
    record("cpu_linear", MODEL, "all linear projections of one forward pass, float32", figures)


if __name__ == "__main__":
    main()
