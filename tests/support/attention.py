"""Paged attention against a dense float64 reference, for mixed prefill/decode batches."""

from __future__ import annotations

import random

import torch

from sluice.kvcache.paged_attention import AttentionMetadata, paged_attention


def reference_attention(q, k, v, scale, window=None, softcap=None):
    """q [Q, H, D] at the last Q of k/v's L positions [L, Hkv, D]; dense, in float64."""
    num_q, num_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    groups = num_heads // num_kv_heads
    k = k.double().repeat_interleave(groups, dim=1)
    v = v.double().repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    pos_q = torch.arange(kv_len - num_q, kv_len)[:, None]
    pos_k = torch.arange(kv_len)[None, :]
    mask = pos_k <= pos_q
    if window is not None:
        mask &= pos_k > pos_q - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_case(seqs, block_size, num_heads=8, num_kv_heads=2, head_dim=16, window=None, softcap=None, seed=0,
             dtype=torch.float32, kernel=None):
    """seqs: (context_len, q_len) per sequence, packed in that order. Returns (max error, output)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-(c + q) // block_size) for c, q in seqs]
    num_blocks = sum(blocks_needed) + 5
    # Non-contiguous tables: blocks handed out in a shuffled order; the cache starts full of garbage.
    free = list(range(num_blocks))
    rng.shuffle(free)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 100
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 100
    tables, queries, keys, values, slots, full_kv = [], [], [], [], [], []
    for (ctx, q_len), n_blocks in zip(seqs, blocks_needed, strict=True):
        table = [free.pop() for _ in range(n_blocks)]
        tables.append(table)
        k = torch.randn(ctx + q_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(ctx + q_len, num_kv_heads, head_dim, generator=gen)
        full_kv.append((k, v))
        for pos in range(ctx):  # the cached context, as earlier steps would have written it
            key_cache[table[pos // block_size], pos % block_size] = k[pos]
            value_cache[table[pos // block_size], pos % block_size] = v[pos]
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=gen))
        keys.append(k[ctx:])
        values.append(v[ctx:])
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + q_len)]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = AttentionMetadata.build(
        [q for _, q in seqs], [c + q for c, q in seqs], block_tables, torch.tensor(slots), block_size, kernel
    )
    scale = head_dim**-0.5
    queries, keys, values = ([t.to(dtype) for t in ts] for ts in (queries, keys, values))
    full_kv = [(k.to(dtype), v.to(dtype)) for k, v in full_kv]
    key_cache, value_cache = key_cache.to(dtype), value_cache.to(dtype)
    out = paged_attention(
        torch.cat(queries), torch.cat(keys), torch.cat(values), key_cache, value_cache, meta, scale, window, softcap
    )
    expected = torch.cat([
        reference_attention(q, k, v, scale, window, softcap) for q, (k, v) in zip(queries, full_kv, strict=True)
    ])
    # The new K/V must have landed in their slots.
    flat_k, flat_v = (cache.view(-1, num_kv_heads, head_dim) for cache in (key_cache, value_cache))
    assert torch.equal(flat_k[torch.tensor(slots)], torch.cat(keys))
    assert torch.equal(flat_v[torch.tensor(slots)], torch.cat(values))
    return (out.double() - expected).abs().max().item(), out


MIXES = {
    "decodes": [(37, 1), (5, 1), (0, 1), (64, 1)],
    "prefill_only": [(0, 29)],
    "chunk_with_context": [(40, 23)],
    "mixed": [(33, 1), (0, 17), (12, 1), (20, 9), (0, 1), (50, 1)],
    "decodes_then_prefills": [(3, 1), (70, 1), (16, 16), (0, 5)],
}
