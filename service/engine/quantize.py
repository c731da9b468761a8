"""`--quantization`: which weight-only scheme replaces a model's linears at load."""

from __future__ import annotations

from torch import nn

from sluice.service.engine import int4_linear, int8_linear


def quantize(model: nn.Module, method: str) -> int:
    """Replace every nn.Linear of `model` in place by `method`'s quantized linear ('int8' or 'int4'); how many."""
    schemes = {"int8": int8_linear.quantize_linears, "int4": int4_linear.quantize_linears}
    if method not in schemes:
        raise ValueError(f"unknown quantization {method!r}: one of {', '.join(schemes)}")
    return schemes[method](model)
