"""Weight-only int8 linears (`--quantization int8`) in GGUF's Q8_0 layout: 8.5 bits per weight streamed per step.

Each row is cut into groups of 32 inputs; a group keeps a float16 scale d = max|w| / 127 and 32 int8 values q,
and stands for q * d, exactly as llama.cpp stores Q8_0 (so weights that were dequantized from Q8_0 come back
bit for bit). Up to KERNEL_MAX_ROWS input rows run through csrc/int8_linear.cpp (built by `sluice.native`), which reads
each group once and widens it in registers: at batch 1 that is what bounds a decode step on CPU. More rows (long
prefill chunks) or no compiler: dequantize per call and run fp32 GEMM. A linear whose input size is not a
multiple of 32 stays float32.
"""

from __future__ import annotations

import torch

from sluice.service.engine.quantized_linear import GROUP, QuantizedLinear

# Measured on 2 Zen 4 cores over SmolLM2's linears: the kernel takes 77 ms at 32 rows, 153 at 64, 304 at 128 and
# 621 at 256; dequantize + GEMM 172, 221, 318 and 516.
KERNEL_MAX_ROWS = 128


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


class Int8Linear(QuantizedLinear):
    """An nn.Linear (no grad) with Q8_0-layout int8 weights; float32 activations in and out."""

    kernel_max_rows = KERNEL_MAX_ROWS

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, kernel=None) -> None:
        super().__init__(weight, bias, kernel)
        q, scale = quantize_weight(weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)

    def kernel_forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.kernel.int8_linear(rows, self.qweight, self.scale)

    def kernel_op(self):
        if self.kernel is None or self.bias is not None:
            return None
        return self.kernel.QuantizedLinearOp(8, self.qweight, self.scale, torch.empty(0), self.out_features)

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.qweight, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 Q8_0 groups of {GROUP}"

