"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, min_tokens, logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sluice.scheduling.output import ScheduledRequest, TokenLogprobs

_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per row, plus logprobs for the rows that asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def row_seed(seed: int, num_output_tokens: int) -> int:
    """A 64-bit generator seed from (request seed, output position): a given output position draws the same
    random number whatever the batch, and however often the request was preempted (splitmix64 finaliser)."""
    x = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + num_output_tokens + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample(logits: torch.Tensor, requests: Sequence[ScheduledRequest]) -> SamplerOutput:
    """Pick the next token for each row of `logits` [B, V] (float32), row i belonging to requests[i]."""
    params = [r.sampling_params for r in requests]
    logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    # Logprobs are reported from the raw distribution, before masking and temperature (as vLLM does).
    raw_logprobs = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None
    logits = _mask_stop_tokens(logits, requests)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        token_ids = logits.argmax(dim=-1)
    elif len(random_rows) == len(params):
        token_ids = _sample_random(logits, list(requests))
    else:
        rows = torch.tensor(random_rows, device=logits.device)
        greedy_rows = torch.tensor([i for i, p in enumerate(params) if p.greedy], device=logits.device)
        token_ids = torch.empty(len(params), dtype=torch.long, device=logits.device)
        token_ids[greedy_rows] = logits[greedy_rows].argmax(dim=-1)
        token_ids[rows] = _sample_random(logits[rows], [requests[i] for i in random_rows])
    token_list = token_ids.tolist()
    logprobs: list[TokenLogprobs | None] = [None] * len(requests)
    if logprob_rows:
        top_ns = [params[i].logprobs for i in logprob_rows]
        entries = _gather_logprobs(raw_logprobs, token_ids[logprob_rows], top_ns)
        for row, entry in zip(logprob_rows, entries, strict=True):
            logprobs[row] = entry
    return SamplerOutput(token_list, logprobs)


def _mask_stop_tokens(logits: torch.Tensor, requests: Sequence[ScheduledRequest]) -> torch.Tensor:
    """-inf on EOS and stop_token_ids for rows still short of min_tokens (a copy only when needed)."""
    rows, cols = [], []
    for i, r in enumerate(requests):
        if r.min_tokens_pending:
            stops = list(r.sampling_params.stop_token_ids)
            if r.eos_token_id is not None:
                stops.append(r.eos_token_id)
            stops = [t for t in stops if 0 <= t < logits.shape[-1]]  # ids past the vocab cannot be sampled anyway
            rows += [i] * len(stops)
            cols += stops
    if not rows:
        return logits
    logits = logits.clone()
    logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
    return logits


def _sample_random(logits: torch.Tensor, requests: list[ScheduledRequest]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p filtering, then one inverse-CDF draw per row."""
    params = [r.sampling_params for r in requests]
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    logits = logits / temperature[:, None]
    top_k = [p.top_k for p in params]
    if any(k > 0 for k in top_k):
        logits = _apply_top_k(logits, top_k)
    top_p = [p.top_p for p in params]
    if any(p < 1.0 for p in top_p):
        logits = _apply_top_p(logits, top_p)
    probs = torch.softmax(logits, dim=-1)
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        threshold = torch.tensor(min_p, device=device)[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    # Inverse CDF needs one uniform per row, where an exponential race (Gumbel) would need one per vocab
    # entry: on CPU drawing B x V exponentials costs more than the whole rest of sampling.
    uniforms = torch.rand(len(params), 1, device=device, dtype=torch.float64)
    for i, p in enumerate(params):
        if p.seed is not None:
            generator = torch.Generator().manual_seed(row_seed(p.seed, requests[i].num_output_tokens))
            uniforms[i] = torch.rand(1, generator=generator, dtype=torch.float64).item()
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, the first cdf entry above the target always belongs to a positive-prob token.
    target = torch.minimum((uniforms * total).to(cdf.dtype), torch.nextafter(total, torch.zeros_like(total)))
    ids = torch.searchsorted(cdf, target, right=True)[:, 0]
    # A row whose probabilities under/overflowed has no valid CDF: fall back to its argmax.
    bad = ~torch.isfinite(total[:, 0]) | (total[:, 0] <= 0)
    return torch.where(bad, logits.argmax(dim=-1), ids)


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """-inf outside each row's k best logits (top_k 0 keeps the row whole)."""
    k = torch.tensor([min(k, logits.shape[-1]) for k in top_k], device=logits.device)[:, None]
    kth = logits.topk(int(k.max()), dim=-1).values.gather(1, k.clamp(min=1) - 1)
    kth.masked_fill_(k == 0, float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


# Candidate pool sizes for the nucleus: a partial topk is ~10x cheaper than sorting the vocabulary, and
# the nucleus almost always fits in the first pool; rows whose nucleus does not escalate to the next.
TOP_P_CANDIDATES = (256, 4096)


def _apply_top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """-inf outside each row's nucleus: the best tokens while the mass strictly before them is < top_p."""
    device, vocab = logits.device, logits.shape[-1]
    top_p_t = torch.tensor(top_p, device=device, dtype=logits.dtype)
    log_norm = torch.logsumexp(logits, dim=-1)
    threshold = torch.full((len(top_p),), float("-inf"), device=device, dtype=logits.dtype)
    pending = torch.tensor([i for i, p in enumerate(top_p) if p < 1.0], device=device)
    for size in (*TOP_P_CANDIDATES, vocab):
        k = min(size, vocab)
        rows = logits if pending.numel() == len(top_p) else logits[pending]
        values = rows.topk(k, dim=-1).values
        probs = (values - log_norm[pending, None]).exp()
        kept = ((probs.cumsum(dim=-1) - probs) < top_p_t[pending, None]).sum(dim=-1).clamp_(min=1)  # the best always stays
        closed = (kept < k) | (k == vocab)  # the nucleus ends inside this pool
        threshold[pending[closed]] = values[closed].gather(1, (kept[closed] - 1)[:, None])[:, 0]
        pending = pending[~closed]
        if pending.numel() == 0:
            break
    return logits.masked_fill(logits < threshold[:, None], float("-inf"))


def _gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, top_ns: list[int]) -> list[TokenLogprobs]:
    """The sampled token's logprob and the top-N alternatives, per row."""
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0].tolist()
    max_n = max(top_ns)
    top_values, top_ids = logprobs.topk(max_n, dim=-1) if max_n else (logprobs[:, :0], logprobs[:, :0].long())
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(token_id=t, logprob=lp, top=list(zip(ids[:n], vals[:n], strict=True)))
        for t, lp, ids, vals, n in zip(token_ids.tolist(), chosen, top_ids, top_values, top_ns, strict=True)
    ]
