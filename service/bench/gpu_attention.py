"""gpu-check's attention stage: each paged-attention backend here, and the Triton decode kernel, against a dense
float64 reference on cases of decodes and prompt chunks over shuffled block tables (the tests' case builder too)."""

from __future__ import annotations

import torch

from sluice.service.attention import triton_decode


def backends_here(device: torch.device) -> list[str]:
    """The paged-attention backends that run on `device`."""
    from sluice.service.attention.paged_attention import resolve_backend

    names = []
    for name in ("torch", "flex", "flash", "triton"):
        try:
            names.append(resolve_backend(name, device, 16))
        except ValueError:
            pass
    return names


ATTENTION_MIXES = {
    "decodes": [(37, 1), (5, 1), (0, 1), (64, 1), (300, 1)],
    "mixed": [(33, 1), (0, 17), (12, 1), (20, 9), (0, 1), (50, 1)],
    "chunk_with_context": [(40, 200), (0, 130)],
}


def check_attention(device: torch.device, dtypes=(torch.float32, torch.bfloat16), tiny: bool = False,
                    flex: bool = False) -> dict:
    """Each backend here against a dense float64 reference: mixes of decodes and chunks over shuffled block
    tables in a cache full of garbage, block sizes 16 and 64, with and without a sliding window and softcap.
    `flex`: FlexAttention alone (it compiles per case: a stage of its own), else every other backend.
    `tiny`: each mix, block size and mask once (the CPU self-test; tests/attention cover the kernels' cases)."""
    from sluice.service.attention.paged_attention import AttentionMetadata, paged_attention

    report: dict = {}
    masks = ((None, None), (8, None), (None, 5.0))
    # the decode steps' kernel (the one CUDA graphs capture): no compile, first
    if triton_decode.available(device) and not flex:
        for dtype in dtypes:
            cases = [(bs, window, softcap) for bs in (16, 64) for window, softcap in masks]
            worst = max(triton_decode_error(ATTENTION_MIXES["decodes"], bs, device, dtype, i, window, softcap)
                        for i, (bs, window, softcap) in enumerate(cases))
            report[f"triton_decode/{str(dtype).removeprefix('torch.')}"] = {
                "max_abs_error": worst, "cases": len(cases), "ok": worst < (1e-4 if dtype == torch.float32 else 5e-2)}
    cases = [(mix, bs, window, softcap) for mix in ATTENTION_MIXES for bs in (16, 64) for window, softcap in masks]
    if tiny:
        cases = [(mix, (16, 64)[i % 2], *masks[i]) for i, mix in enumerate(ATTENTION_MIXES)]
    for backend in backends_here(device):
        if (backend == "flex") != flex:
            continue
        for dtype in dtypes:
            worst = 0.0
            for i, (mix, bs, window, softcap) in enumerate(cases):
                q, k, v, kc, vc, args, expected = paged_attention_case(ATTENTION_MIXES[mix], bs, device, dtype, i,
                                                                       window, softcap)
                meta = AttentionMetadata.build(*args, backend=backend)
                out = paged_attention(q, k, v, kc, vc, meta, q.shape[-1] ** -0.5, window, softcap)
                worst = max(worst, (out.double() - expected).abs().max().item())
            name = str(dtype).removeprefix("torch.")
            report[f"{backend}/{name}"] = {"max_abs_error": worst, "cases": len(cases),
                                           "ok": worst < (1e-4 if dtype == torch.float32 else 5e-2)}
    report["ok"] = all(v["ok"] for v in report.values())
    return report


def triton_decode_error(seqs, block_size, device, dtype, seed, window=None, softcap=None, **shape) -> float:
    """The Triton decode kernel on one case of decodes (q_len 1 each) against the dense reference."""
    from sluice.service.attention.paged_attention import write_kv

    q, k, v, kc, vc, args, expected = paged_attention_case(seqs, block_size, device, dtype, seed, window, softcap,
                                                           **shape)
    write_kv(k, v, kc, vc, args[3])
    lens = torch.tensor(args[1], device=device)
    out = triton_decode.paged_decode(q, kc, vc, args[2], lens, q.shape[-1] ** -0.5, window, softcap)
    return (out.double() - expected).abs().max().item()


def paged_attention_case(seqs, block_size, device, dtype, seed, window=None, softcap=None, num_heads=8,
                         num_kv_heads=2, head_dim=64, kv_dtype=None):
    """(context_len, q_len) per sequence, packed: the new q/k/v, a cache full of garbage with the contexts written
    into shuffled blocks, AttentionMetadata.build's arguments and the dense float64 reference output. `kv_dtype`:
    the cache's dtype where it differs from `dtype` (the reference sees K/V rounded to it)."""
    kv_dtype = kv_dtype or dtype
    import random

    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    needed = [-(-(c + q) // block_size) for c, q in seqs]
    num_blocks = sum(needed) + 5
    free = list(range(num_blocks))
    rng.shuffle(free)
    kc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 100
    vc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 100
    tables, queries, keys, values, slots, full = [], [], [], [], [], []
    for (ctx, q_len), n in zip(seqs, needed, strict=True):
        table = [free.pop() for _ in range(n)]
        tables.append(table)
        k = torch.randn(ctx + q_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(ctx + q_len, num_kv_heads, head_dim, generator=gen)
        for pos in range(ctx):
            kc[table[pos // block_size], pos % block_size] = k[pos]
            vc[table[pos // block_size], pos % block_size] = v[pos]
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=gen))
        keys.append(k[ctx:])
        values.append(v[ctx:])
        full.append((k, v))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + q_len)]
    width = max(needed)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    args = ([q for _, q in seqs], [c + q for c, q in seqs], block_tables, torch.tensor(slots, device=device),
            block_size)
    on = [t.to(device, dtype) for t in (torch.cat(queries), torch.cat(keys), torch.cat(values))]
    on += [t.to(device, kv_dtype) for t in (kc, vc)]
    expected = torch.cat([dense_attention(q.to(dtype), k.to(kv_dtype), v.to(kv_dtype), head_dim ** -0.5, window,
                                          softcap) for q, (k, v) in zip(queries, full, strict=True)]).to(device)
    return (*on, args, expected)


def dense_attention(q, k, v, scale, window=None, softcap=None):
    """q [Q, H, D] at the last Q of k/v's L positions; float64."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    pos_q = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    pos_k = torch.arange(k.shape[0])[None, :]
    mask = pos_k <= pos_q
    if window is not None:
        mask &= pos_k > pos_q - window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)
