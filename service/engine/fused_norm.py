"""RMSNorm layers run as one C++ op on CPU, float32 or bf16 (csrc/rms_norm.cpp), instead of eight eager ops.

Like transformers' own kernel hub (`use_kernel_forward_from_hub("RMSNorm")`), this swaps a layer's forward for a
kernel that computes the same thing. A layer is swapped only if its class's `forward` is, source for source,
transformers' Llama RMSNorm forward (Llama, Mistral, Qwen2/3, Phi-3, Granite, SmolLM3, GLM ... share it), so a
model family whose norm differs (Gemma's 1 + weight, OLMo-2's order) keeps its own.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from sluice.service.engine import cpu_ops
from sluice.service.engine.module_swap import same_source, swap_modules

FUSED_DTYPES = (torch.float32, torch.bfloat16)


def _computes_llama_rms_norm(module: nn.Module) -> bool:
    return same_source(type(module).forward, LlamaRMSNorm.forward)


class FusedRMSNorm(nn.Module):
    """A Llama RMSNorm whose float32 or bf16 CPU forward is one C++ op; any other input takes the eager formula."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """weight * (x / sqrt(mean(x^2) + eps)), the statistics in float32."""
        ops = cpu_ops.load()  # looked up, not held: a module attribute would make the layer impossible to deepcopy
        if ops is not None and hidden_states.dtype == self.weight.dtype in FUSED_DTYPES \
                and hidden_states.device.type == "cpu":
            return ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)
        input_dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fused"


def fuse_rms_norms(model: nn.Module) -> int:
    """Swap every Llama-formula RMSNorm of `model` for a FusedRMSNorm, in place; returns how many."""
    return swap_modules(model, _computes_llama_rms_norm, FusedRMSNorm)
