"""Verifying n-gram drafts in the sampler: which of a request's d draft tokens the model accepts, and the token
after them.

The forward gives logits at each of the request's 1 + d positions (its last known token, then each draft).
Position j is sampled as if drafts 0..j-1 had already been accepted: its row carries them in its token history
(penalties, bad words) and in its output count (min_tokens, the seed's position), so logit processors see
exactly what one-token decoding would have shown them.

- Greedy: drafts are accepted while each equals the argmax of its position; the first mismatch emits that
  argmax, and a fully accepted run emits the argmax after the last draft (the bonus token). The output is the
  one-token decoder's.
- Sampled: the draft is a one-hot proposal q, so speculative rejection sampling accepts draft x with
  probability p(x) and otherwise samples from p with x removed, renormalized (max(0, p - q) normalized); a
  fully accepted run samples the bonus token from the last position's p. Every emitted token is distributed as
  one-token sampling from p. A seeded request draws its accept test from (seed, position) on a stream of its
  own and its token from the same (seed, position) number as one-token sampling, so a seed reproduces its text.
"""

from __future__ import annotations

import dataclasses

import torch

from sluice.kvcache.transfer import to_device
from sluice.scheduling.output import ScheduledRequest
from sluice.service.engine.sampler import (
    draw,
    filtered_logits,
    greedy_ids,
    mask_stop_tokens,
    read_back,
    row_uniforms,
)

_ACCEPT_STREAM = 0x5BEC_DEC0_DE00_0001  # xor-ed into a request's seed for its accept tests


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
        row_drafts = [t for r in requests for t in [*r.draft_token_ids, -1]]  # -1: the row after the last draft
        drafts = [row_drafts[i] for i in random_rows]
        cols = to_device([max(d, 0) for d in drafts], torch.long, device)[:, None]
        p_draft = torch.softmax(filtered, dim=-1).gather(1, cols)[:, 0]
        # The residual of row j: p without its draft (a bonus row, draft -1, keeps p whole).
        is_draft = to_device([d >= 0 for d in drafts], torch.bool, device)[:, None]
        residual = filtered.scatter(1, cols, torch.where(is_draft, float("-inf"), filtered.gather(1, cols)))
        parts += [draw(residual, uniforms).double(), p_draft.double()]
    flat = read_back(torch.cat(parts))
    n = len(rows)
    target = [int(t) for t in flat[:n]]
    resampled, accept = {}, {}
    if random_rows:
        m = len(random_rows)
        resampled = dict(zip(random_rows, (int(t) for t in flat[n : n + m]), strict=True))
        # accept[row]: whether the row's draft passes its test, u < p(draft)
        u = row_uniforms([rows[i] for i in random_rows], _ACCEPT_STREAM)
        accept = {row: ui < p for row, ui, p in zip(random_rows, u, flat[n + m : n + 2 * m], strict=True)}
    runs, first = [], 0
    for r in requests:
        runs.append(_run(r, first, target, resampled, accept))
        first += 1 + len(r.draft_token_ids)
    return runs


def _run(r: ScheduledRequest, first: int, target: list[int], resampled: dict, accept: dict) -> list[int]:
    """Accept r's drafts left to right (its rows start at `first`); the first rejection ends the run."""
    greedy = r.sampling_params.greedy
    run = []
    for j, draft in enumerate(r.draft_token_ids):
        row = first + j
        if greedy:
            accepted, other = target[row] == draft, target[row]
        else:
            accepted, other = accept[row], resampled[row]
        if not accepted:
            return [*run, other]
        run.append(draft)
    last = first + len(r.draft_token_ids)
    return [*run, target[last] if greedy else resampled[last]]
