"""Per-request logit controls, batched: penalties, logit_bias, allowed_token_ids, bad words.

Applied in place to the float32 logits of the rows being sampled, before the sampler (and before grammar masks,
so a bias can never re-allow a token a grammar forbids). Rows whose controls are all neutral are not touched,
so a batch without controls costs one scan of its requests. The maths is tensor ops over the batch; Python
loops only build index lists from the requests' tokens and bad-word lists, never over the vocabulary.
"""

from __future__ import annotations

import torch

from sluice.scheduling.output import ScheduledRequest


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


def _bias(logits, requests, rows, vocab) -> None:
    r_idx, t_idx, values = [], [], []
    for i in rows:
        for token, bias in (requests[i].sampling_params.logit_bias or {}).items():
            if 0 <= token < vocab:
                r_idx.append(i)
                t_idx.append(token)
                values.append(bias)
    if r_idx:
        index = (torch.tensor(r_idx, device=logits.device), torch.tensor(t_idx, device=logits.device))
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)


def _allowed(logits, requests, rows) -> None:
    for i in rows:
        allowed = requests[i].sampling_params.allowed_token_ids
        if allowed is not None:
            keep = torch.tensor(allowed, device=logits.device)
            kept = logits[i, keep].clone()
            logits[i] = float("-inf")
            logits[i, keep] = kept


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
        logits[torch.tensor(r_idx, device=logits.device), torch.tensor(t_idx, device=logits.device)] = float("-inf")


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
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    index = torch.tensor(rows, device=device)
    sub = logits[index]
    sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    sub = sub - frequency * counts - presence * (counts > 0)
    logits[index] = sub


def _has_penalty(r: ScheduledRequest) -> bool:
    p = r.sampling_params
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


def _scatter_counts(id_lists: list[list[int]], n: int, vocab: int, device) -> torch.Tensor:
    """[n, vocab] float counts of each token id in each list."""
    width = max((len(ids) for ids in id_lists), default=0)
    counts = torch.zeros(n, vocab + 1, device=device)
    if width:
        padded = torch.full((n, width), vocab, dtype=torch.long)
        for row, ids in enumerate(id_lists):
            if ids:
                padded[row, : len(ids)] = torch.tensor(ids, dtype=torch.long).clamp_(0, vocab)
        padded = padded.to(device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]
