"""Weight-only int4 linears (`--quantization int4`) in GGUF's Q4_1 layout: 5 bits per weight streamed per step.

Each row is cut into groups of 32 inputs; a group keeps a float16 scale d and minimum m (m = the group's minimum,
d = its range / 15) and 32 nibbles q in 0..15, and stands for q * d + m. Byte j of a group's 16 holds elements j
(low nibble) and j + 16 (high nibble), as llama.cpp stores Q4_1, so a GGUF's Q4_1 blocks map onto these values
unchanged. For weights that were themselves dequantized from Q4_1 (the default model's GGUF), quantizing again
gives back the same values.

For up to KERNEL_MAX_ROWS rows, csrc/int4_linear.cpp (built by `sluice.native`) quantizes the activations to int8 per
group of 32 (scale max|x| / 127), as llama.cpp does for Q4_1, and sums exact u8 x s8 products with vpdpbusd
(AVX512-VNNI) or pmaddubsw (AVX2). Float activations made the kernel compute-bound (widening each nibble to a
float): 2.2x slower over SmolLM2's linears at one row. The cost is a small error per linear (`bench quant` reports
perplexity and greedy agreement). The kernel reads the bytes regrouped 16 output rows to a block (`pack`: a
permutation, nothing added but padding to a multiple of 16 rows). More rows than KERNEL_MAX_ROWS, or no compiler,
dequantize per call and run fp32 GEMM. The output head becomes int8 (Q8_0), not int4 (llama.cpp's Q4_1 files keep it at Q8_0 too: in
4 bits it alone took SmolLM2's perplexity from 7.10 to 7.52). A linear whose input size is not a multiple of 32
stays float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.service.engine.quantized_linear import GROUP, QuantizedLinear

BLOCK = 16  # output rows per kernel block
# Over SmolLM2's 210 layer linears on 2 Zen 4 cores the kernel takes 32 ms at 64 rows, 74 at 128, 145 at 256, 285
# at 512 and 544 at 1024; dequantize + fp32 GEMM 511, 662, 780, 864 and 1456. So the kernel takes every prefill
# chunk a step schedules; the dequantized path is left for batches past this (and for a machine without a compiler).
KERNEL_MAX_ROWS = 4096


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
    """The fp32 weight [N, K] these Q4_1 buffers stand for."""
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()
    w = q * scale.float()[..., None] + minimum.float()[..., None]
    return w.reshape(nibbles.shape[0], -1)


def pack(nibbles: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor):
    """Q4_1 buffers of N rows → the kernel's blocks of 16 rows (N padded with zero rows):
    nibbles [N/16, G, 4, 16, 4] (chunk c, row o: bytes 4c..4c+3 of row o's group), scale and minimum [N/16, G, 16]."""
    n, g, _ = nibbles.shape
    pad = -n % BLOCK
    nibbles, scale, minimum = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (nibbles, scale, minimum))
    blocks = (n + pad) // BLOCK
    packed = nibbles.reshape(blocks, BLOCK, g, 4, 4).permute(0, 2, 3, 1, 4).contiguous()
    return (packed, *(t.reshape(blocks, BLOCK, g).transpose(1, 2).contiguous() for t in (scale, minimum)))


def unpack(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, n: int):
    """The inverse of pack: Q4_1 buffers of the first n rows (nibbles [n, G, 16], scale and minimum [n, G])."""
    blocks, g = packed.shape[:2]
    nibbles = packed.permute(0, 3, 1, 2, 4).reshape(blocks * BLOCK, g, 16)[:n]
    return (nibbles, *(t.transpose(1, 2).reshape(blocks * BLOCK, g)[:n] for t in (scale, minimum)))


class Int4Linear(QuantizedLinear):
    """An nn.Linear (no grad) with Q4_1 int4 weights, packed for the kernel; float32 activations in and out."""

    kernel_max_rows = KERNEL_MAX_ROWS

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, kernel=None) -> None:
        super().__init__(weight, bias, kernel)
        packed, scale, minimum = pack(*quantize_weight(weight))
        self.register_buffer("qweight", packed)
        self.register_buffer("scale", scale)
        self.register_buffer("minimum", minimum)

    def q4_1(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The weight as GGUF's Q4_1 buffers: nibbles [N, K/32, 16], scale and minimum float16 [N, K/32]."""
        return unpack(self.qweight, self.scale, self.minimum, self.out_features)

    def kernel_forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.kernel.int4_linear(rows, self.qweight, self.scale, self.minimum, self.out_features)

    def kernel_op(self):
        if self.kernel is None or self.bias is not None:
            return None
        return self.kernel.QuantizedLinearOp(4, self.qweight, self.scale, self.minimum, self.out_features)

    def dequantized(self) -> torch.Tensor:
        return dequantize(*self.q4_1())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 Q4_1 groups of {GROUP}"

