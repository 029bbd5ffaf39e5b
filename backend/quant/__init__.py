"""Quantized weights: GGUF formats (formats.py) decoded into one class (weight.py), and the
linear op on it (linear.py) with its CPU kernel (cpu_kernel.py, cpu_kernel.c)."""

from __future__ import annotations

from sgl.backend.quant.formats import FORMATS, decode, supported
from sgl.backend.quant.linear import quant_linear, quant_linear_reference
from sgl.backend.quant.weight import QuantizedWeight

__all__ = ["FORMATS", "QuantizedWeight", "decode", "quant_linear", "quant_linear_reference",
           "supported"]
