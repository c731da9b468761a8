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

    def __init__(self, linear: nn.Linear, kernel=None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.kernel = kernel  # the built CPU ops (cpu_ops.load()), or None: every call dequantizes

    @abstractmethod
    def kernel_forward(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, K] → [M, N] through the kernel."""

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
