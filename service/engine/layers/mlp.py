"""The gated MLP of the Llama family: down(silu(gate(x)) * up(x)), gate and up in one fused linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sluice.service.engine.layers import triton_ops


class GatedMLP(nn.Module):
    """SiLU and the product run in place on the fused projection's fresh output."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj
        self.intermediate_size = down_proj.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, E] → [T, E]."""
        if triton_ops.applies(x):  # CUDA: one kernel for both
            return self.down_proj(triton_ops.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        F.silu(gate, inplace=True)  # a slice of a fresh tensor: free to overwrite
        return self.down_proj(gate.mul_(up))
