"""Weight-only int4 linears (`--quantization int4`) in GGUF's Q4_1 layout: 5 bits per weight streamed per step.

Each row is cut into groups of 32 inputs; a group keeps a float16 scale d and minimum m (m = the group's minimum,
d = its range / 15) and 32 nibbles q in 0..15, and stands for q * d + m. Byte j of a group's 16 holds elements j
(low nibble) and j + 16 (high nibble), as llama.cpp stores Q4_1, so a GGUF's Q4_1 blocks map onto these buffers
unchanged. For weights that were themselves dequantized from Q4_1 (the default model's GGUF), quantizing again
gives back the same values, so the outputs are fp32's.

Activations stay float32. (Quantizing them to int8 per group of 32, as llama.cpp does for Q4_1, was measured: on
2 Zen 4 cores no faster than this kernel, and it would change the arithmetic, so outputs would drift from
fp32's.) Up to KERNEL_MAX_ROWS rows run through csrc/int4_linear.cpp (built by `cpu_ops`); more rows, or no
compiler, dequantize per call and run fp32 GEMM. The output head becomes int8 (Q8_0), not int4 (llama.cpp's Q4_1
files keep it at Q8_0 too: in 4 bits it alone took SmolLM2's perplexity from 7.10 to 7.52). A linear whose input
size is not a multiple of 32 stays float32.
"""

from __future__ import annotations

import torch
from torch import nn

from sluice.service.engine import cpu_ops
from sluice.service.engine.int8_linear import Int8Linear
from sluice.service.engine.quantized_linear import GROUP, QuantizedLinear, replace_fitting_linears

# Measured as int8's: the kernel takes 83 ms at 32 rows, 165 at 64, 328 at 128, 690 at 256; dequantize + GEMM
# 260, 303, 394 and 580.
KERNEL_MAX_ROWS = 128


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp weight [N, K] → (nibbles uint8 [N, K/32, 16], scale float16 [N, K/32], minimum float16 [N, K/32])."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"int4 groups need in_features divisible by {GROUP}, not {k}")
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)
    low, high = w.amin(-1), w.amax(-1)
    minimum = low.half()
    scale = ((high - low) / 15).half()
    # Rounded against the float16 values actually stored, so each weight lands within half a step of them.
    d, m = scale.float(), minimum.float()
    q = torch.where(d[..., None] > 0, torch.round((w - m[..., None]) / d[..., None].clamp_min(1e-30)), 0.0)
    q = q.clamp_(0, 15).to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    return nibbles.contiguous(), scale.contiguous(), minimum.contiguous()


def dequantize(nibbles: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] these buffers stand for."""
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()
    w = q * scale.float()[..., None] + minimum.float()[..., None]
    return w.reshape(nibbles.shape[0], -1)


class Int4Linear(QuantizedLinear):
    """An nn.Linear (no grad) with Q4_1-layout int4 weights; float32 activations in and out."""

    kernel_max_rows = KERNEL_MAX_ROWS

    def __init__(self, linear: nn.Linear, kernel=None) -> None:
        super().__init__(linear, kernel)
        nibbles, scale, minimum = quantize_weight(linear.weight)
        self.register_buffer("qweight", nibbles)
        self.register_buffer("scale", scale)
        self.register_buffer("minimum", minimum)

    def kernel_forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.kernel.int4_linear(rows, self.qweight, self.scale, self.minimum)

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.qweight, self.scale, self.minimum)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 Q4_1 groups of {GROUP}"


def quantize_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` by an Int4Linear, in place (the output head by an Int8Linear; a linear
    whose input size is not a multiple of 32 stays float32); returns how many were replaced."""
    kernel = cpu_ops.load()
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    return replace_fitting_linears(
        model, lambda linear: Int8Linear(linear, kernel) if linear is head else Int4Linear(linear, kernel), "int4"
    )
