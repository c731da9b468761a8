"""`--quantization`: which weight-only scheme replaces a model's linears at load."""

from __future__ import annotations

import logging
from collections import Counter

from torch import nn

from sluice.service.engine import cpu_ops, int4_linear, int8_linear
from sluice.service.engine.prepack import replace_linears
from sluice.service.engine.quantized_linear import fits

logger = logging.getLogger("sluice.quantize")

# GGUF block types whose layout a linear here stores exactly: such a weight requantizes bit for bit.
GGUF_LINEARS = {"Q4_1": int4_linear.Int4Linear, "Q8_0": int8_linear.Int8Linear}


def quantize(model: nn.Module, method: str, gguf_types: dict[str, str] | None = None) -> int:
    """Replace the linears of `model` in place by `method`'s quantized ones ('int8', 'int4', or 'gguf': each in
    its GGUF type, from `gguf_types`, {module name: type}); returns how many were replaced."""
    if method == "gguf":
        if gguf_types is None:
            raise ValueError("gguf quantization needs the GGUF type of each linear")
        return _quantize_as_stored(model, gguf_types)
    schemes = {"int8": int8_linear.quantize_linears, "int4": int4_linear.quantize_linears}
    if method not in schemes:
        raise ValueError(f"unknown quantization {method!r}: one of {', '.join(schemes)}, gguf")
    return schemes[method](model)


def _quantize_as_stored(model: nn.Module, gguf_types: dict[str, str]) -> int:
    kernel = cpu_ops.load()
    names = {id(m): n for n, m in model.named_modules()}
    kept: Counter[str] = Counter()
    made: Counter[str] = Counter()

    def make(linear: nn.Linear) -> nn.Module:
        stored = gguf_types.get(names[id(linear)], "none")
        cls = GGUF_LINEARS.get(stored)
        if cls is None or not fits(linear):
            kept[stored] += 1
            return linear
        made[stored] += 1
        return cls(linear, kernel)

    replace_linears(model, make)
    logger.info("gguf: linears served in their file's type: %s; kept float32: %s",
                dict(made) or "none", dict(kept) or "none")
    return sum(made.values())
