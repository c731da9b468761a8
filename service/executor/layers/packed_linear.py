"""CPU linears on oneDNN-prepacked weights (`PackedMethod`, `--prepack-weights`).

torch's plain CPU linear goes through MKL's sgemm, which re-lays-out the weight on every call; a weight packed once
at load for oneDNN's GEMM skips that. The plain weight is dropped after packing, so memory does not grow; a head tied
to the embedding stays plain (the embedding needs the plain weight). Calls of up to `max_rows` rows read the packed
layout in packed_gemv's GEMV (where it recognises the layout), larger ones run oneDNN's GEMM on the same bytes.
"""

from __future__ import annotations

import functools
from collections import Counter

import torch

from sluice import native
from sluice.service.executor import packed_gemv
from sluice.service.executor.layers.crossover import crossover, kept_limit, probe_weights
from sluice.service.executor.layers.linear import (
    PACK_BATCH_HINT,
    Linear,
    LinearMethod,
    PlainFormat,
    onednn_linear,
    pad_rows,
    set_bias,
    taking_kernel,
)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN prepacking applies on CPU to fp32, and to bf16 where this CPU multiplies bf16 natively."""
    return (
        device.type == "cpu"
        and (dtype == torch.float32 or (dtype == torch.bfloat16 and packed_gemv.bf16_native()))
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedMethod(LinearMethod):
    """The weight kept only in oneDNN's blocked layout (`layer.packed`, an opaque tensor: a plain attribute, not a
    parameter or buffer, so state_dict, .parameters() and .to() leave it alone). `gemv_layout`: the layout as the
    GEMV reads it (None: oneDNN alone serves every call), `packed_ptr` where its bytes lie."""

    gemv_layout: tuple[int, int] | None = None
    packed_ptr = 0

    def create_weights(self, layer, weight, bias):
        with torch.no_grad():
            layer.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        set_bias(layer, bias)
        self.dtype = weight.dtype
        self.gemv_layout = packed_gemv.gemv_layout(layer.packed, weight)
        if self.gemv_layout:
            self.max_rows = packed_max_rows(weight.dtype, tuple(weight.shape))
            self.packed_ptr = torch.ops.mkldnn.data_ptr(layer.packed)
        return weight.shape

    def apply(self, layer, rows):
        if self.gemv_layout and rows.shape[0] <= self.max_rows:
            out = packed_gemv.gemv(rows, self.packed_ptr, layer.out_features, self.gemv_layout)
            if layer.bias is not None:
                out += layer.bias
            return out
        padded, m = pad_rows(rows, layer.in_features)
        return onednn_linear(padded, layer.packed, layer.bias)[:m]

    def layer_op(self, layer):
        ops = native.load()
        if ops is None or not self.gemv_layout:
            return None
        return ops.LayerLinear(layer.packed, self.packed_ptr, *self.gemv_layout, layer.out_features, layer.bias)

    def dense_weight(self, layer):
        return layer.packed.to_dense()

    def rebuilt(self, layer):
        # Opaque tensors cannot be deep-copied; repack from a dense copy instead.
        return PackedLinear(self.dense_weight(layer), None if layer.bias is None else layer.bias.detach().clone())

    def describe(self, layer):
        return f"packed, GEMV up to {self.max_rows} rows" if self.max_rows else "packed"


class PackedLinear(Linear):
    """A Linear on its oneDNN-prepacked weight (PackedMethod)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(PackedMethod(), weight, bias)


@functools.cache
def packed_max_rows(dtype: torch.dtype, shape: tuple[int, int]) -> int:
    """The most rows a call may have on the packed-layout GEMV here for a weight of `shape` [N, K] (0: oneDNN always
    wins), timed once per dtype and shape on this machine, on probe weights packed as PackedMethod packs its own
    (crossover.py)."""

    def measure() -> int:
        weights = probe_weights(shape, dtype)
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT) for w in weights]
        layout = packed_gemv.gemv_layout(packed[0], weights[0])
        if layout is None:
            return 0
        n, ptrs = weights[0].shape[0], [torch.ops.mkldnn.data_ptr(p) for p in packed]
        del weights
        return crossover(lambda x: [packed_gemv.gemv(x, ptr, n, layout) for ptr in ptrs],
                         lambda x: [onednn_linear(pad_rows(x, shape[1])[0], p, None) for p in packed], shape[1],
                         dtype)

    return kept_limit(f"packed {dtype} {shape[0]}x{shape[1]}", measure)


class PackedFormat(PlainFormat):
    """oneDNN-prepacked weights (the plain one is dropped), decode-sized calls in the packed-layout GEMV."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(device, dtype)
        self.packed_limits = Counter()  # the packed linears' max_rows
        self.name = "prepacked for oneDNN"

    def make(self, weight, bias, parts, sizes, tied=False):
        if tied:  # a packed copy of the embedding would hold the same bytes twice
            return super().make(weight, bias, parts, sizes, tied)
        packed = PackedLinear(weight, bias)
        self.packed_limits[packed.method.max_rows] += 1
        return packed

    def describe(self) -> str:
        gemv, plain = taking_kernel(self.packed_limits), taking_kernel(self.row_limits)
        tied = f"; the tied head plain, C++ GEMV: {plain}" if plain else ""
        return f"{self.name}, read by the packed-layout GEMV: {gemv or 'none'} (rows: linears){tied}"
