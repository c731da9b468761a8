"""RMSNorm, one C++ op on CPU for float32 and bf16 (csrc/rms_norm.cpp) and one Triton kernel on CUDA, instead of
eight eager ops."""

from __future__ import annotations

import torch
from torch import nn

from sluice import native
from sluice.service.executor.layers import triton_ops

FUSED_DTYPES = (torch.float32, torch.bfloat16)


class RMSNorm(nn.Module):
    """weight * (x / sqrt(mean(x^2) + eps)), the statistics in float32, as transformers' Llama computes it."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The C++ op where it applies (CPU, float32 or bf16), else the eager formula."""
        if triton_ops.applies(hidden_states):  # CUDA: one kernel instead of eight
            return triton_ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)
        # The extension looked up, not held (a module attribute would make the layer impossible to deepcopy), and
        # only on CPU: a CUDA model must not build the CPU kernels.
        ops = native.load() if hidden_states.device.type == "cpu" else None
        if ops is not None and hidden_states.dtype == self.weight.dtype in FUSED_DTYPES:
            return ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)
        input_dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
