"""The forward context: what the attention of one forward reads beside its inputs (the step's attention metadata,
every layer's KV cache, the step's adapter rows).

The model runner sets it around each forward (and the KV cache's profile forward around its own); Sluice's own
layers read it (`layers/attention.py`, `lora/layers.py`, `models/llama.py`), and so does the transformers fallback's
attention hook (`service/attention/attention_backend.py`), which is handed `get_forward_context` when registered.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from sluice.service.attention.paged_attention import AttentionMetadata


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
