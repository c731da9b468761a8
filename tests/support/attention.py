"""Paged attention against a dense float64 reference, for mixed prefill/decode batches."""

from __future__ import annotations

import torch

from sluice.service.attention.paged_attention import KERNEL_ROWS_MAX, AttentionMetadata, paged_attention
from sluice.service.bench.gpu_attention import paged_attention_case


def run_case(seqs, block_size, num_heads=8, num_kv_heads=2, head_dim=16, window=None, softcap=None, seed=0,
             dtype=torch.float32, kernel=None, kv_dtype=None, kernel_rows_max=KERNEL_ROWS_MAX):
    """seqs: (context_len, q_len) per sequence, packed in that order; `kv_dtype` the cache's, where it differs
    from `dtype`; sequences of up to `kernel_rows_max` query rows go to `kernel`. Returns (max error, output)."""
    q, k, v, key_cache, value_cache, args, expected = paged_attention_case(
        seqs, block_size, torch.device("cpu"), dtype, seed, window, softcap, num_heads, num_kv_heads, head_dim,
        kv_dtype)
    meta = AttentionMetadata.build(*args, kernel, kernel_rows_max=kernel_rows_max)
    out = paged_attention(q, k, v, key_cache, value_cache, meta, head_dim**-0.5, window, softcap)
    # The new K/V must have landed in their slots.
    slots = args[3]
    flat_k, flat_v = (cache.view(-1, num_kv_heads, head_dim) for cache in (key_cache, value_cache))
    assert torch.equal(flat_k[slots], k.to(key_cache.dtype)) and torch.equal(flat_v[slots], v.to(value_cache.dtype))
    return (out.double() - expected).abs().max().item(), out


MIXES = {
    "decodes": [(37, 1), (5, 1), (0, 1), (64, 1)],
    "prefill_only": [(0, 29)],
    "chunk_with_context": [(40, 23)],
    "mixed": [(33, 1), (0, 17), (12, 1), (20, 9), (0, 1), (50, 1)],
    "decodes_then_prefills": [(3, 1), (70, 1), (16, 16), (0, 5)],
}
