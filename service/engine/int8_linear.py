"""Weight-only int8 linears (`--quantization int8`) in GGUF's Q8_0 layout: 8.5 bits per weight streamed per step.

Each row is cut into groups of 32 inputs; a group keeps a float16 scale d = max|w| / 127 and 32 int8 values q,
and stands for q * d, exactly as llama.cpp stores Q8_0 (so weights that were dequantized from Q8_0 come back
bit for bit). Up to KERNEL_MAX_ROWS input rows run through csrc/int8_linear.cpp (built by `cpu_ops`), which reads
each group once and widens it in registers: at batch 1 that is what bounds a decode step on CPU. More rows (long
prefill chunks) or no compiler: dequantize per call and run fp32 GEMM. A linear whose input size is not a
multiple of 32 stays float32.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from sluice.service.engine import cpu_ops
from sluice.service.engine.prepack import replace_linears

logger = logging.getLogger("sluice.quantize")

# Measured on 2 Zen 4 cores over SmolLM2's linears: the kernel takes 77 ms at 32 rows, 153 at 64, 304 at 128 and
# 621 at 256; dequantize + GEMM 172, 221, 318 and 516.
KERNEL_MAX_ROWS = 128
GROUP = 32


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp weight [N, K] → (int8 [N, K], float16 scale [N, K/32]), symmetric per group of 32 inputs."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"int8 groups need in_features divisible by {GROUP}, not {k}")
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)
    scale = (w.abs().amax(-1) / 127).half()
    d = scale.float()[..., None]  # rounded against the float16 scale actually stored
    q = torch.where(d > 0, torch.round(w / torch.where(d > 0, d, 1.0)), 0.0).clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, k).contiguous(), scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] these buffers stand for."""
    n, k = q.shape
    return (q.float().reshape(n, k // GROUP, GROUP) * scale.float()[..., None]).reshape(n, k)


class Int8Linear(nn.Module):
    """An nn.Linear (no grad) with Q8_0-layout int8 weights; float32 activations in and out."""

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
        return dequantize(self.qweight, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] float32 → [..., N]."""
        rows = x.reshape(-1, self.in_features)
        if self.kernel is not None and rows.shape[0] <= KERNEL_MAX_ROWS:
            out = self.kernel.int8_linear(rows, self.qweight, self.scale)
        else:
            out = F.linear(rows, self.dequantized())
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 Q8_0 groups of {GROUP}"


def quantize_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` (lm_head included) whose input size is a multiple of 32 by an Int8Linear,
    in place; returns how many were replaced."""
    kernel = cpu_ops.load()
    replaced = replace_linears(model, lambda linear: Int8Linear(linear, kernel) if fits(linear) else linear)
    misfits = sum(type(m) is nn.Linear for m in model.modules())
    if misfits:
        logger.info("%d linears have an input size not divisible by %d and stay float32", misfits, GROUP)
    return replaced - misfits


def fits(linear: nn.Linear) -> bool:
    """Whether a linear's input splits into whole groups of 32."""
    return linear.in_features % GROUP == 0
