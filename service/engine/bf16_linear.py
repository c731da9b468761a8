"""bf16 linears whose decode-sized calls run csrc/bf16_linear.cpp, on CPUs with AVX512_BF16.

torch's bf16 linear on CPU goes through oneDNN, whose GEMV streamed SmolLM2's weights at ~8 GB/s on 2 Zen 4
cores: a batch-1 step spent ~30 ms in linears. The kernel (vdpbf16ps, float32 accumulation, as oneDNN's) reads
the same plain weight, so nothing is copied; calls with more rows than KERNEL_MAX_ROWS keep torch's path.
"""

from __future__ import annotations

import torch
from torch import nn

from sluice.service.engine import cpu_ops
from sluice.service.engine.prepack import PaddedLinear

# Over SmolLM2's linears on 2 Zen 4 cores: 10.4 ms against torch's 28.7 at 1 row, 32.6 against 38.9 at 16, 58.5
# against 48.8 at 32.
KERNEL_MAX_ROWS = 16


class Bf16DecodeLinear(PaddedLinear):
    """A PaddedLinear (same weight, same state_dict) whose bf16 calls of few rows run the AVX512_BF16 kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Same result as nn.Linear.forward, up to float32 summation order."""
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > KERNEL_MAX_ROWS or rows.dtype != torch.bfloat16 or self.weight.dtype != torch.bfloat16:
            return super().forward(x)
        out = cpu_ops.load().bf16_linear(rows, self.weight)
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)


def use_bf16_kernel(model: nn.Module) -> int:
    """Give every PaddedLinear of `model` the kernel path, in place (no weight is copied); returns how many."""
    targets = [m for m in model.modules() if type(m) is PaddedLinear]
    for linear in targets:
        linear.__class__ = Bf16DecodeLinear
    return len(targets)
