"""The gated MLP of the Llama family: down(silu(gate(x)) * up(x)), gate and up in one fused linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sluice.service.executor.layers import triton_ops


class GatedMLP(nn.Module):
    """SiLU of the fused projection's gate half into a fresh tensor, the product in place on it."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj
        self.intermediate_size = down_proj.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, E] → [T, E]."""
        if triton_ops.applies(x):  # CUDA: one kernel for both
            return self.down_proj(triton_ops.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        # Out of place: SiLU writes a fresh contiguous tensor, which the down projection reads as it is, where the
        # gate's slice (rows 2 * intermediate apart) would be copied into one first.
        return self.down_proj(F.silu(gate).mul_(up))
