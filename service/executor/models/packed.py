"""One packed batch (every scheduled token as a single sequence) through the served model, Sluice's own
Llama-family forward or a transformers fallback alike: the runner's steps and the KV cache's profile call these."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch

from sluice.service.executor.models.llama import LlamaForCausalLM


def packed_logits(model, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """input_ids and positions [T] → the logits of `rows` [n, V]."""
    if isinstance(model, LlamaForCausalLM):
        return model.compute_logits(input_ids, positions, rows)
    if _keeps_rows(type(model)):
        return model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                     logits_to_keep=rows).logits[0]
    # A forward without logits_to_keep computes every row's logits: correct, only slower.
    return model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False).logits[0, rows]


def packed_hidden(model, input_ids: torch.Tensor,
                  positions: torch.Tensor) -> tuple[torch.Tensor, Callable, Callable]:
    """(the last layer's output [T, E], the final norm, the head) for pooling: norm and head then run on the rows
    wanted only. transformers' decoder ends with its final norm, so its norm here is the identity."""
    if isinstance(model, LlamaForCausalLM):
        return model.hidden_states(input_ids, positions), model.norm, model.lm_head
    hidden = model.get_decoder()(input_ids=input_ids[None], position_ids=positions[None],
                                 use_cache=False).last_hidden_state[0]
    return hidden, (lambda h: h), model.get_output_embeddings()


@functools.cache
def _keeps_rows(model_class: type) -> bool:
    """Whether a transformers model's forward takes logits_to_keep (read once per class)."""
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters
