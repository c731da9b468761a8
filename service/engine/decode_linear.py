"""CPU linears on plain weights whose decode-sized calls run the C++ GEMVs (csrc/f32_linear.cpp, bf16_linear.cpp).

At batch 1 a linear streams its weight once. oneDNN's GEMV streamed SmolLM2's fp32 weights at ~20 GB/s on 2 Zen 4
cores (prepacked or plain alike) and its bf16 weights at ~8 GB/s; the kernels read the same plain [N, K] weight
at ~31 GB/s (fp32) and, with vdpbf16ps, ~26 GB/s (bf16), so nothing is copied. Calls with more rows than
KERNEL_MAX_ROWS go to oneDNN on the same plain weight. For fp32 that is `mkldnn._linear_pointwise`, not
`F.linear`: torch's fp32 linear calls MKL's sgemm, which re-lays-out the weight on every call (1.2-1.6x slower).
These serve the weights that stay plain: a head tied to the embedding, and every linear under
--no-prepack-weights (the others are prepacked and read by packed_gemv's GEMV).
"""

from __future__ import annotations

import torch
from torch import nn

from sluice.service.engine import cpu_ops
from sluice.service.engine.prepack import PaddedLinear, pad_rows

# Over SmolLM2's linears on 2 Zen 4 cores, kernel against oneDNN on the plain weight:
# fp32 19.0 vs 30.9 ms at 1 row, 23.3 vs 37.4 at 4, 47.8 vs 54.9 at 16;
# bf16 10.4 vs 28.7 ms at 1 row, 32.6 vs 38.9 at 16, 58.5 vs 48.8 at 32.
KERNEL_MAX_ROWS = 16


def onednn_linear_available() -> bool:
    """Whether this torch exposes oneDNN's linear on a plain fp32 weight."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class DecodeLinear(PaddedLinear):
    """A PaddedLinear (same weight, same state_dict) whose calls of few rows run the C++ kernel for its dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Same result as nn.Linear.forward, up to float32 summation order."""
        rows = x.reshape(-1, self.in_features)
        if x.dtype != self.weight.dtype or x.dtype not in (torch.float32, torch.bfloat16):
            return super().forward(x)
        if rows.shape[0] > KERNEL_MAX_ROWS:
            if x.dtype != torch.float32 or not onednn_linear_available():
                return super().forward(x)
            padded, m = pad_rows(x, self.in_features)
            out = torch.ops.mkldnn._linear_pointwise(padded, self.weight, self.bias, "none", [], "")
            return out[:m].view(*x.shape[:-1], self.out_features)
        ops = cpu_ops.load()
        out = ops.f32_linear(rows, self.weight) if x.dtype == torch.float32 else ops.bf16_linear(rows, self.weight)
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)


def use_decode_kernels(model: nn.Module) -> int:
    """Give every PaddedLinear of `model` the kernel path, in place (no weight is copied); returns how many."""
    targets = [m for m in model.modules() if type(m) is PaddedLinear]
    for linear in targets:
        linear.__class__ = DecodeLinear
    return len(targets)
