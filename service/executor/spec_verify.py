"""Verifying n-gram drafts in the sampler: which of a request's d draft tokens the model accepts, and the token
after them.

The forward gives logits at each of the request's 1 + d positions (its last known token, then each draft).
Position j is sampled as if drafts 0..j-1 had already been accepted: its row carries them in its token history
(penalties, bad words) and in its output count (min_tokens, the seed's position), so logit processors see
exactly what one-token decoding would have shown them.

- Greedy: drafts are accepted while each equals the argmax of its position; the first mismatch emits that
  argmax, and a fully accepted run emits the argmax after the last draft (the bonus token). The output is the
  one-token decoder's.
- Sampled: each position draws the token one-token sampling would draw there, t ~ p with the row's own
  uniform, and the draft x is accepted when t == x; the first mismatch emits t, a fully accepted run emits the
  bonus position's t. For a one-hot proposal q this is exact speculative rejection sampling: x is accepted with
  probability p(x), and a rejected position's t is distributed as p without x, renormalized (max(0, p - q)
  normalized). Since every draw is the one-token draw at the same (seed, position), a seeded request emits the
  same text with drafts and without them (logprobs, grammars and allowed_token_ids turn drafts off).
"""

from __future__ import annotations

import dataclasses

import torch

from sluice.kvcache.transfer import to_device
from sluice.scheduling.output import ScheduledRequest
from sluice.service.executor.sampler import (
    draw,
    filtered_logits,
    greedy_ids,
    mask_stop_tokens,
    read_back,
)


def expand_rows(to_sample: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """One row per sampled position: a request with d drafts gives 1 + d rows, row j seeing drafts 0..j-1."""
    rows = []
    for r in to_sample:
        if not r.draft_token_ids:
            rows.append(r)
            continue
        for j in range(len(r.draft_token_ids) + 1):
            n_out = r.num_output_tokens + j
            history = r.token_history + r.draft_token_ids[:j] if r.token_history is not None and j else r.token_history
            rows.append(dataclasses.replace(r, token_history=history, num_output_tokens=n_out, draft_token_ids=[],
                                            min_tokens_pending=n_out < r.sampling_params.min_tokens))
    return rows


def verify(logits: torch.Tensor, requests: list[ScheduledRequest], rows: list[ScheduledRequest]) -> list[list[int]]:
    """The emitted run of each request (accepted drafts, then one token), from `logits` [len(rows), V] float32
    already through the logit processors; `rows` is expand_rows(requests)."""
    device = logits.device
    x = mask_stop_tokens(logits, rows)
    parts = [greedy_ids(x).double()]
    random_rows = [i for i, r in enumerate(rows) if not r.sampling_params.greedy]
    if random_rows:
        index = to_device(random_rows, torch.long, device)
        filtered, uniforms = filtered_logits(x[index], [rows[i] for i in random_rows])
        parts.append(draw(filtered, uniforms).double())
    flat = read_back(torch.cat(parts))
    n = len(rows)
    target = [int(t) for t in flat[:n]]
    for k, row in enumerate(random_rows):  # a sampled row's target is its one-token draw
        target[row] = int(flat[n + k])
    runs, first = [], 0
    for r in requests:
        runs.append(_run(r, first, target))
        first += 1 + len(r.draft_token_ids)
    return runs


def _run(r: ScheduledRequest, first: int, target: list[int]) -> list[int]:
    """Accept r's drafts left to right while each equals its position's target (its rows start at `first`); the
    first mismatch emits that target and ends the run."""
    run = []
    for j, draft in enumerate(r.draft_token_ids):
        if target[first + j] != draft:
            return [*run, target[first + j]]
        run.append(draft)
    return [*run, target[first + len(r.draft_token_ids)]]
