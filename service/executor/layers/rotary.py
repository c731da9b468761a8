"""Rotary position embedding: cos and sin per position from the config, applied to q and k in place."""

from __future__ import annotations

import torch
from torch import nn

from sluice import native
from sluice.service.executor.layers import triton_ops

ROTARY_DTYPES = (torch.float32, torch.bfloat16)
# Rope types whose frequencies do not change with the sequence length (transformers' "dynamic" and "longrope"
# rescale on the fly): the others run on transformers' model.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config) -> dict:
    """The config's rope parameters (rope_type, rope_theta, ...), under either transformers spelling."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


class RotaryEmbedding(nn.Module):
    """cos, sin [T, D] for positions [T], computed as transformers' Llama rotary embedding does (the same ops)."""

    def __init__(self, config, head_dim: int) -> None:
        super().__init__()
        params = rope_parameters(config)
        if params["rope_type"] == "default":
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            self.attention_scaling = 1.0
        else:  # transformers' own formulas for the scaled variants (config arithmetic, no modeling code)
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] long → (cos, sin), each [T, head_dim] in `dtype`."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, H, D] and k [T, Hkv, D] in place by cos, sin [T, D], as transformers' Llama does."""
    if triton_ops.applies(q):  # CUDA: q and k in one kernel instead of twelve
        triton_ops.rotary(q, k, cos, sin)
        return
    ops = native.load() if q.device.type == "cpu" else None
    if ops is not None and q.dtype in ROTARY_DTYPES and q.dtype == k.dtype == cos.dtype == sin.dtype:
        ops.rotary_embedding_(q, k, cos, sin)
        return
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = q.shape[-1] // 2
    for x in (q, k):
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * cos + rotated * sin)
