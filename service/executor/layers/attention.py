"""Self-attention on the paged KV cache: fused q/k/v projection, optional per-head q/k norms (Qwen3), rotary in
place, then `paged_attention` (service/attention's backends: the C decode kernel on CPU, SDPA, FlexAttention,
flash-attn).

The projections keep their [T, H, D] views (no transposes): each is a fresh tensor or a slice of one, so rotary
runs in place on it (one C++ op on CPU).
"""

from __future__ import annotations

import torch
from torch import nn

from sluice.service.attention.paged_attention import paged_attention
from sluice.service.executor.forward_context import get_forward_context
from sluice.service.executor.layers.rotary import apply_rotary


class PagedAttention(nn.Module):
    """One layer's attention: hidden [T, E] → [T, E], reading and writing its blocks of the forward context's
    cache."""

    def __init__(self, qkv_proj: nn.Module, o_proj: nn.Module, num_heads: int, num_kv_heads: int, head_dim: int,
                 layer_idx: int, q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.qkv_proj, self.o_proj = qkv_proj, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qkv_heads = [num_heads, num_kv_heads, num_kv_heads]
        self.layer_idx, self.scaling, self.sliding_window = layer_idx, head_dim ** -0.5, sliding_window

    def project(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [T, H, D], k and v [T, Hkv, D]: projected, normed (Qwen3) and rotated."""
        q, k, v = self.qkv_proj(hidden).view(hidden.shape[0], -1, self.head_dim).split(self.qkv_heads, dim=1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        apply_rotary(q, k, cos, sin)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k and v [T, Hkv, D] (rotated) on this layer's paged cache → [T, H, D]."""
        context = get_forward_context()
        key_cache, value_cache = context.kv_caches[self.layer_idx]
        meta = context.attn_metadata
        # A window wider than every sequence of the step masks nothing: leave it out, so the decode kernel applies.
        window = self.sliding_window if self.sliding_window and meta.max_seqlen_k > self.sliding_window else None
        return paged_attention(q, k, v, key_cache, value_cache, meta, scale=self.scaling, sliding_window=window)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """hidden [T, E] → [T, E]."""
        return self.o_proj(self.attend(*self.project(hidden, cos, sin)).reshape(hidden.shape[0], -1))
