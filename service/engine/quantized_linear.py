"""What the weight-only quantized linears (int8_linear, int4_linear) share: groups of 32 inputs, a kernel for
few rows with the dequantized weight as the fallback, and swapping in only the linears whose input fits whole groups.
"""

from __future__ import annotations

import logging
from abc import ABCMeta, abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sluice.service.engine.prepack import replace_linears

logger = logging.getLogger("sluice.quantize")

GROUP = 32  # inputs per scale, as in GGUF's Q8_0 and Q4_1 blocks


def fits(linear: nn.Linear) -> bool:
    """Whether a linear's input splits into whole groups of 32."""
    return linear.in_features % GROUP == 0


class QuantizedLinear(nn.Module, metaclass=ABCMeta):
    """An nn.Linear (no grad) whose weight a subclass stores quantized; float32 activations in and out."""

    kernel_max_rows: int  # the most input rows the kernel takes; above, dequantize + GEMM is faster
    # The buffers that hold output rows along dim 0, each entry standing for `rows_per_entry` rows (int4: a block
    # of 16): what fuse_linears concatenates.
    row_buffers: tuple[str, ...]
    rows_per_entry: int = 1

    def __init__(self, linear: nn.Linear, kernel=None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.kernel = kernel  # the built CPU ops (cpu_ops.load()), or None: every call dequantizes

    @abstractmethod
    def kernel_forward(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, K] → [M, N] through the kernel."""

    def kernel_op(self):
        """This linear as the C++ object csrc/llama_layer.cpp calls (its kernel, its tensors), or None."""
        return None

    @abstractmethod
    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [N, K] the quantized values stand for."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] float32 → [..., N]."""
        rows = x.reshape(-1, self.in_features)
        if self.kernel is not None and rows.shape[0] <= self.kernel_max_rows:
            out = self.kernel_forward(rows)
        else:
            out = F.linear(rows, self.dequantized())
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)


def fuse_linears(linears: list[nn.Module]) -> QuantizedLinear | None:
    """One linear computing all of `linears` (projections of one input, as q, k and v are) in one kernel call, their
    outputs side by side. Each of them keeps working alone: its buffers become views into the fused ones, so
    nothing is stored twice. None where they differ in class or input, carry a bias, or split a block of rows."""
    first = linears[0]
    cls = type(first)
    if not isinstance(first, QuantizedLinear) or any(
        type(linear) is not cls or linear.in_features != first.in_features or linear.bias is not None
        or linear.kernel is not first.kernel or linear.out_features % cls.rows_per_entry for linear in linears
    ):
        return None
    fused = cls.__new__(cls)
    nn.Module.__init__(fused)
    fused.in_features, fused.out_features = first.in_features, sum(linear.out_features for linear in linears)
    fused.bias, fused.kernel = None, first.kernel
    for name in cls.row_buffers:
        whole = torch.cat([getattr(linear, name) for linear in linears])
        fused.register_buffer(name, whole)
        start = 0
        for linear in linears:
            entries = linear.out_features // cls.rows_per_entry
            setattr(linear, name, whole[start:start + entries])
            start += entries
    return fused


def replace_fitting_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module], scheme: str) -> int:
    """Replace every nn.Linear of `model` whose input fits whole groups by make(linear), in place; the rest stay
    float32 (logged). Returns how many were replaced."""
    misfits = 0

    def make_if_fits(linear: nn.Linear) -> nn.Module:
        nonlocal misfits
        if fits(linear):
            return make(linear)
        misfits += 1
        return linear

    replaced = replace_linears(model, make_if_fits)
    if misfits:
        logger.info("%s: %d linears have an input size not divisible by %d and stay float32", scheme, misfits, GROUP)
    return replaced - misfits
