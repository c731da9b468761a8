"""Weight-only int8 linears (`--quantization int8`): a quarter of the fp32 weight bytes streamed per decode step.

Weights are quantized at load, symmetric, one scale per output channel: q = round(w / s), s = max|w_row| / 127.
Up to KERNEL_MAX_ROWS input rows run through csrc/int8_linear.cpp (built by `cpu_ops`), which reads each int8 row
once and widens it in registers: at batch 1 that is what bounds a decode step on CPU (memory, not arithmetic).
Larger batches (long prefill chunks) are compute-bound: they dequantize the weight per call and run fp32 GEMM.
Without a C++ compiler every batch size takes the dequantize path, which is correct but slower.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sluice.service.engine import cpu_ops
from sluice.service.engine.prepack import replace_linears

# Measured on 2 Zen 4 cores over SmolLM2's linears: the kernel takes 62 ms at 32 rows, 113 at 64 and 471 at 256,
# dequantize + GEMM 232, 178 and 625; at 512 rows they tie (916 vs 927 ms).
KERNEL_MAX_ROWS = 512


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp weight [N, K] → (int8 [N, K], float32 scale [N]), symmetric per output channel."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class Int8Linear(nn.Module):
    """An nn.Linear (no grad) with its weight kept as per-channel int8; float32 activations in and out."""

    def __init__(self, linear: nn.Linear, kernel=None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_weight(linear.weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.bias = linear.bias
        self.kernel = kernel

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight these int8 values stand for."""
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] float32 → [..., N]."""
        rows = x.reshape(-1, self.in_features)
        if self.kernel is not None and rows.shape[0] <= KERNEL_MAX_ROWS:
            out = self.kernel.int8_linear(rows, self.qweight, self.scale)
        else:
            # Scaling the [M, N] output instead of the [N, K] weight: one temporary the weight's size, not two.
            out = F.linear(rows, self.qweight.float()) * self.scale
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def quantize_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` (lm_head included) by an Int8Linear, in place; returns how many."""
    kernel = cpu_ops.load()
    return replace_linears(model, lambda linear: Int8Linear(linear, kernel))
