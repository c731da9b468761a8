"""Llama attention layers with a lean forward for the paged cache: rotary in one C++ op, no head transposes.

transformers' forward projects q, k and v, transposes each to [1, H, T, D], applies rotary as sixteen small
ops, looks up the attention function by name, and the paged hook then transposes back. At batch 1 on CPU
that glue costs more than the attention itself (~90 µs a layer). This forward keeps the projections'
[T, H, D] views, rotates q and k in place with `cpu_ops.rotary_embedding_` (bit for bit the eager result),
and calls `paged_attention` directly. Like `fused_norm`, a layer is swapped only if its class's forward and
its module's `apply_rotary_pos_emb` are, source for source, transformers' Llama ones.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
from torch import nn
from transformers.models.llama import modeling_llama

from sluice.kvcache.paged_attention import paged_attention
from sluice.service.engine import cpu_ops
from sluice.service.engine.attention_backend import get_forward_context

ROTARY_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _computes_llama_attention(cls: type) -> bool:
    try:
        rotary = getattr(sys.modules[cls.__module__], "apply_rotary_pos_emb", None)
        return (inspect.getsource(cls.forward) == inspect.getsource(modeling_llama.LlamaAttention.forward)
                and rotary is not None
                and inspect.getsource(rotary) == inspect.getsource(modeling_llama.apply_rotary_pos_emb))
    except (OSError, TypeError):
        return False


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, H, D] and k [T, Hkv, D] in place by cos, sin [T, D], as transformers' Llama does."""
    ops = cpu_ops.load()
    if ops is not None and q.device.type == "cpu" and q.dtype in ROTARY_DTYPES \
            and q.dtype == k.dtype == cos.dtype == sin.dtype:
        ops.rotary_embedding_(q, k, cos, sin)
        return
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = q.shape[-1] // 2
    for x in (q, k):
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * cos + rotated * sin)


class PagedLlamaAttention(nn.Module):
    """A Llama attention layer reading and writing the paged KV cache of the forward context."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.config = attn.config
        self.layer_idx = attn.layer_idx
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """hidden_states [1, T, E] (the runner packs every sequence into one row) → ([1, T, E], None)."""
        batch, tokens = hidden_states.shape[:2]
        assert batch == 1, "the paged cache packs a step's sequences into one row"
        # Each projection is a fresh tensor: its [T, H, D] view can be rotated in place.
        q = self.q_proj(hidden_states).view(tokens, -1, self.head_dim)
        k = self.k_proj(hidden_states).view(tokens, -1, self.head_dim)
        v = self.v_proj(hidden_states).view(tokens, -1, self.head_dim)
        cos, sin = position_embeddings
        apply_rotary(q, k, cos[0], sin[0])
        context = get_forward_context()
        key_cache, value_cache = context.kv_caches[self.layer_idx]
        out = paged_attention(q, k, v, key_cache, value_cache, context.attn_metadata, scale=self.scaling)
        return self.o_proj(out.reshape(1, tokens, -1)), None


def lean_attention_layers(model: nn.Module) -> int:
    """Swap every Llama-formula attention layer of `model` for a PagedLlamaAttention, in place; returns how many."""
    # Llama's forward passes no window to the attention: a config that sets one must keep its own forward.
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if _computes_llama_attention(type(child)) and getattr(child.config, "sliding_window", None) is None]
    for parent, name, child in swaps:
        setattr(parent, name, PagedLlamaAttention(child))
    return len(swaps)
