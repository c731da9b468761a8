"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, min_tokens, logprobs.

No host syncs in the hot path. Every per-row parameter is packed on the host into one tensor and sent with a
single non-blocking copy from pinned memory; the maths runs over the whole batch with shapes known on the host
(no boolean indexing, no `.item()`, no Python loop over rows on the device); the sampled ids (and the logprobs
of the rows that asked for them) come back in one device-to-host transfer, the step's only sync.

Seeded sampling. A random row draws exactly one uniform number u in [0, 1) and picks the token at u in the
cumulative distribution of its filtered, renormalised probabilities, taken in vocabulary order (inverse-CDF
sampling: exact, and one number per row where the Gumbel-max trick needs one per vocabulary entry). For a
request with a seed, u = splitmix64(seed, num_output_tokens) / 2**64 (`row_seed`), computed on the host: the
token at output position k depends only on (seed, k) and that row's logits and parameters, not on the batch
it shares, its row in it, the other rows' parameters, or how often the request was preempted (recompute
replays the same positions). So the same seed and prompt give the same output whatever else is running (on
the same device and dtype: another device may round the logits differently). Unseeded rows draw u from
torch's default CPU generator.

Filters: top-k, then top-p over the top-k-renormalised distribution, are prefix conditions on the row's
tokens sorted by logit, so they run as one sort + mask over the batch; on CUDA that is a full sort (or a top-k
of the largest k when no row uses top-p). On CPU, where reading a value back costs nothing, the sort is replaced
by top-`w` candidate pools that widen (256, 4096, vocabulary) until every row's nucleus ends inside the pool: a
full 49k-entry sort costs ~15 ms per row on CPU, a pool a few hundred microseconds. A row's kept set is the same
whichever pool closes it. min-p (p < min_p x the best token's p) is a threshold, applied without sorting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sluice import native
from sluice.kvcache.transfer import to_device
from sluice.scheduling.output import ScheduledRequest, TokenLogprobs

_MASK64 = (1 << 64) - 1
# CPU candidate pool sizes for the filters; the vocabulary is always the last resort.
CPU_CANDIDATES = (256, 4096)


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per row, plus logprobs for the rows that asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def row_seed(seed: int, num_output_tokens: int) -> int:
    """A 64-bit number from (request seed, output position): a given output position draws the same random
    number whatever the batch, and however often the request was preempted (splitmix64 finaliser)."""
    x = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + num_output_tokens + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, num_output_tokens: int) -> float:
    """The uniform in [0, 1) a seeded request draws at an output position (53 bits of `row_seed`)."""
    return (row_seed(seed, num_output_tokens) >> 11) * 2.0**-53


def read_back(values: torch.Tensor) -> list[float]:
    """The step's one device-to-host transfer (and sync): sampled ids, then the logprob rows' numbers."""
    return values.tolist()


def pools_allowed(device: torch.device) -> bool:
    """Whether the filters may read a value back to pick a candidate pool: only where that costs no sync."""
    return device.type == "cpu"


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, [B, V] -> [B]: max's indices, the first maximum as argmax picks (ties, NaN). On CPU the
    native kernel's (threads and vector compares, where torch's max reduction compares an element at a time on one
    thread), else torch's max, which is several times faster than its argmax (docs/history.md)."""
    kernel = native.load() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if kernel is not None and logits.dim() == 2 and logits.shape[1] > 0:
        return kernel.greedy_argmax(logits)
    return logits.max(dim=-1).indices


def sample(logits: torch.Tensor, requests: Sequence[ScheduledRequest]) -> SamplerOutput:
    """Pick the next token for each row of `logits` [B, V] (float32), row i belonging to requests[i]."""
    device, num_rows = logits.device, logits.shape[0]
    params = [r.sampling_params for r in requests]
    logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    raw_logprobs = None
    if logprob_rows:  # reported from the raw distribution, before masking and temperature (as vLLM does)
        rows = logits if len(logprob_rows) == num_rows else logits[to_device(logprob_rows, torch.long, device)]
        raw_logprobs = torch.log_softmax(rows, dim=-1)
    logits = mask_stop_tokens(logits, requests)
    token_ids = greedy_ids(logits)  # greedy rows: exactly argmax
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        if len(random_rows) == num_rows:
            token_ids = _sample_random(logits, list(requests))
        else:
            index = to_device(random_rows, torch.long, device)
            token_ids.index_copy_(0, index, _sample_random(logits[index], [requests[i] for i in random_rows]))
    parts = [token_ids.double()]
    if logprob_rows:
        top_ns = [params[i].logprobs for i in logprob_rows]
        chosen_ids = token_ids if len(logprob_rows) == num_rows else token_ids[to_device(logprob_rows, torch.long,
                                                                                          device)]
        chosen = raw_logprobs.gather(1, chosen_ids[:, None])[:, 0]
        top_values, top_ids = raw_logprobs.topk(max(top_ns), dim=-1)
        parts += [chosen.double(), top_values.double().flatten(), top_ids.double().flatten()]
    flat = read_back(torch.cat(parts))
    token_list = [int(t) for t in flat[:num_rows]]
    logprobs: list[TokenLogprobs | None] = [None] * num_rows
    if logprob_rows:
        n_lp, width = len(logprob_rows), max(top_ns)
        chosen_lp = flat[num_rows : num_rows + n_lp]
        values = flat[num_rows + n_lp : num_rows + n_lp + n_lp * width]
        ids = flat[num_rows + n_lp + n_lp * width :]
        for j, (row, n) in enumerate(zip(logprob_rows, top_ns, strict=True)):
            top = [(int(t), v) for t, v in zip(ids[j * width : j * width + n], values[j * width : j * width + n],
                                               strict=True)]
            logprobs[row] = TokenLogprobs(token_id=token_list[row], logprob=chosen_lp[j], top=top)
    return SamplerOutput(token_list, logprobs)


def pending_stops(r: ScheduledRequest, vocab: int) -> list[int]:
    """EOS and stop_token_ids inside the vocabulary (ids past it cannot be sampled anyway) while the row is still
    short of min_tokens; else none."""
    if not r.min_tokens_pending:
        return []
    return [t for t in [*r.sampling_params.stop_token_ids, r.eos_token_id] if t is not None and 0 <= t < vocab]


def row_uniforms(requests: Sequence[ScheduledRequest], stream: int = 0) -> list[float]:
    """Each row's uniform: a seeded row's from its seed's stream `stream` at its output position, the others'
    from torch's default generator."""
    u = torch.rand(len(requests), dtype=torch.float64).tolist()
    for i, r in enumerate(requests):
        if r.sampling_params.seed is not None:
            u[i] = seeded_uniform(r.sampling_params.seed ^ stream, r.num_output_tokens)
    return u


def mask_stop_tokens(logits: torch.Tensor, requests: Sequence[ScheduledRequest]) -> torch.Tensor:
    """-inf on EOS and stop_token_ids for rows still short of min_tokens (a copy only when needed)."""
    rows, cols = [], []
    for i, r in enumerate(requests):
        stops = pending_stops(r, logits.shape[-1])
        rows += [i] * len(stops)
        cols += stops
    if not rows:
        return logits
    logits = logits.clone()
    fill_at(logits, rows, cols, float("-inf"))
    return logits


def fill_at(x: torch.Tensor, rows: list[int], cols: list[int], value: float) -> None:
    """x[rows[k], cols[k]] = value for every k, with no host sync: the indices go over in one non-blocking copy and
    the values are filled on the device (`x[i, j] = value` would copy a host scalar over with a blocking copy)."""
    index = to_device([rows, cols], torch.long, x.device)
    x.index_put_((index[0], index[1]), x.new_full((len(rows),), value))


def _sample_random(logits: torch.Tensor, requests: list[ScheduledRequest]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p filtering, then one inverse-CDF draw per row."""
    x, uniforms = filtered_logits(logits, requests)
    return draw(x, uniforms)


def filtered_logits(logits: torch.Tensor, requests: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's logits after temperature, top-k, top-p and min-p (-inf outside its support), and the uniform
    [rows, 1] float64 each row draws with (seeded rows: from their seed and output position)."""
    num_rows, vocab = logits.shape
    params = [r.sampling_params for r in requests]
    uniforms = row_uniforms(requests)
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    # One host-to-device copy for every per-row number: temperature, top_p, min_p, top_k, uniform.
    packed = to_device([[p.temperature, p.top_p, p.min_p, k, u] for p, k, u in zip(params, top_k, uniforms,
                                                                                      strict=True)],
                       torch.float64, logits.device)
    x = logits / packed[:, 0:1].to(logits.dtype)
    use_k, use_p = any(k < vocab for k in top_k), any(p.top_p < 1.0 for p in params)
    if use_k or use_p:
        x = _filter(x, packed, max((k for k in top_k if k < vocab), default=0), use_k, use_p)
    if any(p.min_p > 0.0 for p in params):
        # min-p is a threshold relative to the best token (p_i < min_p * p_max, i.e. x_i - x_max < log min_p), the
        # same set before or after renormalising: no sort needed. min_p 0 gives log 0 = -inf, which masks nothing.
        x = x.masked_fill(x - x.amax(dim=-1, keepdim=True) < packed[:, 2:3].to(x.dtype).log(), float("-inf"))
    return x, packed[:, 4:5]


def draw(x: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One inverse-CDF draw per row of softmax(x) at uniforms [rows, 1] float64 (vocabulary order)."""
    probs = torch.softmax(x, dim=-1)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, the first cdf entry above the target always belongs to a positive-prob token.
    target = torch.minimum((uniforms * total).to(cdf.dtype), torch.nextafter(total, torch.zeros_like(total)))
    ids = torch.searchsorted(cdf, target, right=True)[:, 0]
    # A row whose probabilities under/overflowed has no valid CDF: fall back to its argmax.
    bad = ~torch.isfinite(total[:, 0]) | (total[:, 0] <= 0)
    return torch.where(bad, greedy_ids(x), ids)


def _filter(x: torch.Tensor, packed: torch.Tensor, max_k: int, use_k: bool, use_p: bool):
    """-inf outside each row's support: its top_k best, then the nucleus (the best tokens while the mass strictly
    before them is < top_p, over the top-k-renormalised distribution; the best always stays).
    `max_k`: the largest top_k of the rows that set one (0: none does)."""
    vocab = x.shape[-1]
    k_eff = packed[:, 3].long()[:, None]
    top_p = packed[:, 1:2].to(x.dtype)
    active = (k_eff < vocab) | (top_p < 1.0)
    if pools_allowed(x.device) and use_p:
        widths = [w for w in CPU_CANDIDATES if max_k <= w < vocab] + [vocab]
    else:
        widths = [vocab if use_p else max_k]  # closes every row at once: no read-back needed
    log_norm_all = torch.logsumexp(x, dim=-1, keepdim=True) if use_p else None
    for width in widths:
        if width == vocab:
            values, order = x.sort(dim=-1, descending=True, stable=True)
        else:
            values, order = x.topk(width, dim=-1)
        drop = torch.arange(width, device=x.device) >= k_eff
        closed = k_eff <= width
        if use_p:
            log_norm = log_norm_all
            if use_k:
                kept = values.masked_fill(drop, float("-inf"))
                log_norm = torch.where(k_eff < vocab, torch.logsumexp(kept, dim=-1, keepdim=True), log_norm_all)
            probs = (values - log_norm).exp().masked_fill(drop, 0.0)
            drop |= ((probs.cumsum(dim=-1) - probs) >= top_p) & (top_p < 1.0)
            drop[:, 0] = False  # the best token always stays
            closed = closed | (drop[:, -1:] if width < vocab else True)
        closed = closed | ~active
        if width == widths[-1] or bool(closed.all()):  # CPU only: the loop has one width on other devices
            break
    masked = values.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(x, float("-inf")).scatter_(1, order, masked)
    # Rows without a filter keep every token (their pool may not hold their whole support).
    return torch.where(active, filtered, x)
