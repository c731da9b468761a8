"""What the weight-only quantized linears (int8_linear, int4_linear) share: groups of 32 inputs, and a kernel for
few rows with the dequantized weight as the fallback."""

from __future__ import annotations

from abc import ABCMeta, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

GROUP = 32  # inputs per scale, as in GGUF's Q8_0 and Q4_1 blocks


class QuantizedLinear(nn.Module, metaclass=ABCMeta):
    """An nn.Linear (no grad) whose weight a subclass stores quantized; float32 activations in and out."""

    kernel_max_rows: int  # the most input rows the kernel takes; above, dequantize + GEMM is faster

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel=None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.kernel = kernel  # the built CPU ops (native.load()), or None: every call dequantizes

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
