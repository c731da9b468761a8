"""Per-request logit controls, batched: penalties, logit_bias, allowed_token_ids, bad words.

Applied in place to the float32 logits of the rows being sampled, before the sampler (and before grammar masks,
so a bias can never re-allow a token a grammar forbids). Rows whose controls are all neutral are not touched,
so a batch without controls costs one scan of its requests. The maths is tensor ops over the batch; Python
loops only build index lists from the requests' tokens and bad-word lists, never over the vocabulary.

No host syncs: index lists reach the device through `to_device` (pinned, non-blocking) and values are written
with masked_fill_ / index_put_ of device tensors, never a Python scalar put through indexing (a blocking copy
on CUDA). An allowed_token_ids list becomes a [vocab] mask once, at admission (`AllowedMasks`); a step then
costs one masked_fill_ over the constrained rows, whatever the lists' lengths.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sluice.kvcache.transfer import to_device
from sluice.scheduling.output import ScheduledRequest
from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.executor.sampler import fill_at


def apply_logit_controls(logits: torch.Tensor, requests: list[ScheduledRequest]) -> None:
    """The ModelRunner logits processor for SamplingParams' penalties, biases and token restrictions."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.has_logit_controls]
    if not rows:
        return
    vocab = logits.shape[-1]
    _bias(logits, requests, rows, vocab)
    _allowed(logits, requests, rows)
    _bad_words(logits, requests, rows, vocab)
    _penalties(logits, requests, rows, vocab)


def disallowed_mask(allowed: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[vocab] bool on `device`, True for every token outside `allowed`; ValueError for an id outside the vocab."""
    index = torch.tensor(allowed, dtype=torch.long)
    if index.numel() and not (0 <= int(index.min()) and int(index.max()) < vocab):
        bad = next(t for t in allowed if not 0 <= t < vocab)
        raise ValueError(f"token id {bad} in allowed_token_ids is outside the vocabulary (0..{vocab - 1})")
    mask = torch.ones(vocab, dtype=torch.bool).index_fill_(0, index, False)
    if device.type == "cuda":
        mask = mask.pin_memory()
    return mask.to(device, non_blocking=True)


class AllowedMasks:
    """Builds the disallowed-token mask of an allowed_token_ids list at admission, once per list: the n samples and
    prompts of one API call share one list object, so they share one mask (one byte per vocabulary entry)."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self._last: tuple[Sequence[int], torch.Tensor] | None = None

    def get(self, allowed: Sequence[int]) -> torch.Tensor:
        """The mask for `allowed` (the previous call's mask when it is the same list object)."""
        if self._last is None or self._last[0] is not allowed:
            self._last = (allowed, disallowed_mask(allowed, self.vocab, self.device))
        return self._last[1]


def _mask_of(params: SamplingParams, vocab: int, device: torch.device) -> torch.Tensor:
    mask = params.disallowed_token_mask
    if isinstance(mask, torch.Tensor) and mask.shape == (vocab,) and mask.device == device:
        return mask
    # A request that did not come through LLMEngine.add_request: built per step (correct, just slower).
    return disallowed_mask(params.allowed_token_ids, vocab, device)


def _bias(logits, requests, rows, vocab) -> None:
    r_idx, t_idx, values = [], [], []
    for i in rows:
        for token, bias in (requests[i].sampling_params.logit_bias or {}).items():
            if 0 <= token < vocab:
                r_idx.append(i)
                t_idx.append(token)
                values.append(bias)
    if r_idx:
        index = to_device([r_idx, t_idx], torch.long, logits.device)
        logits.index_put_((index[0], index[1]), to_device(values, logits.dtype, logits.device), accumulate=True)


def _allowed(logits, requests, rows) -> None:
    """-inf outside each constrained row's allowed ids: one masked_fill_ over those rows."""
    rows = [i for i in rows if requests[i].sampling_params.allowed_token_ids is not None]
    if not rows:
        return
    vocab, device = logits.shape[-1], logits.device
    masks = [_mask_of(requests[i].sampling_params, vocab, device) for i in rows]
    banned = masks[0][None] if all(m is masks[0] for m in masks) else torch.stack(masks)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(banned, float("-inf"))
        return
    index = to_device(rows, torch.long, device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(banned, float("-inf")))


def _bad_words(logits, requests, rows, vocab) -> None:
    """A bad word's last token is banned when the output so far ends with the rest of it (vLLM's rule)."""
    r_idx, t_idx = [], []
    for i in rows:
        r = requests[i]
        words = r.sampling_params.bad_words_token_ids
        if not words:
            continue
        output = r.token_history[r.num_prompt_tokens :] if r.token_history is not None else []
        for word in words:
            prefix = word[:-1]
            if len(prefix) <= len(output) and (not prefix or output[len(output) - len(prefix) :] == prefix):
                if 0 <= word[-1] < vocab:
                    r_idx.append(i)
                    t_idx.append(word[-1])
    if r_idx:
        fill_at(logits, r_idx, t_idx, float("-inf"))


def _penalties(logits, requests, rows, vocab) -> None:
    rows = [i for i in rows if requests[i].token_history is not None and _has_penalty(requests[i])]
    if not rows:
        return
    device = logits.device
    n = len(rows)
    # Counts of generated tokens (OpenAI's penalties look at the output only) and presence over prompt + output
    # (the repetition penalty's scope), via scatter over padded id rows; id `vocab` is the padding column.
    outputs = [requests[i].token_history[requests[i].num_prompt_tokens :] for i in rows]
    histories = [requests[i].token_history for i in rows]
    counts = _scatter_counts(outputs, n, vocab, device)
    seen = _scatter_counts(histories, n, vocab, device) > 0
    params = [requests[i].sampling_params for i in rows]
    # One copy for the three penalties: [n, 3] presence, frequency, repetition.
    packed = to_device([[p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p in params],
                       logits.dtype, device)
    presence, frequency, repetition = packed[:, 0:1], packed[:, 1:2], packed[:, 2:3]
    index = to_device(rows, torch.long, device)
    sub = logits.index_select(0, index)
    sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    sub = sub - frequency * counts - presence * (counts > 0)
    logits.index_copy_(0, index, sub)


def _has_penalty(r: ScheduledRequest) -> bool:
    p = r.sampling_params
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


def _scatter_counts(id_lists: list[list[int]], n: int, vocab: int, device) -> torch.Tensor:
    """[n, vocab] float counts of each token id in each list."""
    width = max((len(ids) for ids in id_lists), default=0)
    counts = torch.zeros(n, vocab + 1, device=device)
    if width:
        padded = to_device([list(ids) + [vocab] * (width - len(ids)) for ids in id_lists], torch.long, device)
        padded.clamp_(0, vocab)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]
