"""Plugs Sluice's paged attention into transformers models as attn_implementation "sluice_paged".

The model code stays transformers'; each attention layer calls `sluice_paged_attention`, which reads the step's
metadata and the layer's KV cache from the forward context the model runner sets around the forward. That context
belongs to the executor (`service/executor/forward_context.py`), which sits above this room: `register` is handed
its getter, so nothing here imports the executor.
No mask function is registered on purpose: for an implementation absent from `AttentionMaskInterface`,
transformers' `create_causal_mask` / `create_sliding_window_causal_mask` return None without building anything
(its path for "TGI/vLLM backends"), which is exactly what a paged backend wants: the mask lives in the metadata.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from sluice.service.attention.paged_attention import paged_attention

ATTN_IMPLEMENTATION = "sluice_paged"


def sluice_paged_attention(
    forward_context: Callable,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention hook (bound to `forward_context` by `register`): query [1, H, T, D], key/value
    [1, Hkv, T, D] → ([1, T, H, D], None). `forward_context()`: the forward in progress's context, whose
    `kv_caches[layer]` and `attn_metadata` it reads."""
    context = forward_context()
    key_cache, value_cache = context.kv_caches[module.layer_idx]
    out = paged_attention(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        key_cache,
        value_cache,
        context.attn_metadata,
        scale=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
    )
    return out.unsqueeze(0), None


def register(forward_context: Callable) -> str:
    """Register the backend with transformers, reading each forward's context from `forward_context()` (the
    executor's `get_forward_context`); idempotent. Returns the attn_implementation name."""
    # Imported here: transformers' modeling stack takes ~2.5 s to import, and only a model on transformers'
    # forward (the fallback path) needs it; Sluice's own forward calls paged_attention itself.
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, functools.partial(sluice_paged_attention, forward_context))
    return ATTN_IMPLEMENTATION
