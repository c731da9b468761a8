"""Plugs Sluice's paged attention into transformers models as attn_implementation "sluice_paged".

The model code stays transformers'; each attention layer calls `sluice_paged_attention`, which reads the step's
metadata and the layer's KV cache from the forward context the model runner sets around the forward.
No mask function is registered on purpose: for an implementation absent from `AttentionMaskInterface`,
transformers' `create_causal_mask` / `create_sliding_window_causal_mask` return None without building anything
(its path for "TGI/vLLM backends"), which is exactly what a paged backend wants: the mask lives in the metadata.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from sluice.service.attention.paged_attention import AttentionMetadata, paged_attention

ATTN_IMPLEMENTATION = "sluice_paged"


@dataclass(slots=True)
class ForwardContext:
    """What attention layers need during one forward: the step's metadata and every layer's KV cache."""

    attn_metadata: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (key_cache, value_cache)
    lora: object | None = None  # the step's adapter rows (lora/layers.py: LoRABatch); None: no adapter rows


# A plain global, as in vLLM: one forward runs at a time (the engine's worker thread), and attention layers
# must see the context whichever thread the runner uses.
_forward_context: ForwardContext | None = None


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[None]:
    """Make `context` visible to the attention layers for the duration of one forward."""
    global _forward_context
    previous, _forward_context = _forward_context, context
    try:
        yield
    finally:
        _forward_context = previous


def get_forward_context() -> ForwardContext:
    """The context of the forward in progress; raises outside `set_forward_context`."""
    if _forward_context is None:
        raise RuntimeError("sluice_paged attention called outside set_forward_context (not driven by ModelRunner?)")
    return _forward_context


def sluice_paged_attention(
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
    """transformers attention hook: query [1, H, T, D], key/value [1, Hkv, T, D] → ([1, T, H, D], None)."""
    context = get_forward_context()
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


def register() -> str:
    """Register the backend with transformers (idempotent); returns the attn_implementation name."""
    # Imported here: transformers' modeling stack takes ~2.5 s to import, and only a model on transformers'
    # forward (the fallback path) needs it; Sluice's own forward calls paged_attention itself.
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, sluice_paged_attention)
    return ATTN_IMPLEMENTATION
