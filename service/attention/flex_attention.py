"""Paged attention through `torch.nn.attention.flex_attention`, reading KV blocks in place at the engine's block size.

The whole KV cache of a layer, [num_blocks, block_size, Hkv, D], is one long physical key/value sequence
(a view, batch 1, broadcast to every sequence). A BlockMask whose KV tile is the engine's block size lists,
for each sequence, exactly its own physical blocks (its block table), so the kernel visits only those blocks
and never gathers a sequence's history; inside a visited block `mask_mod` maps the physical slot back to its
logical position through a per-step inverse table (`logical[b, physical block]`, -1 when the block is not
the sequence's, as in torch's own `PagedAttention`) and applies the causal rule (and sliding window):
query i of a sequence with kv length L and q length Q sees logical positions j <= L - Q + i. Per query tile
(Q_BLOCK queries) a row lists its blocks in two parts: *full* blocks, wholly visible to every query of the tile,
which the compiled kernels read without calling mask_mod, and *partial* ones (the diagonal, the window's edge);
blocks the tile cannot see at all are not listed. The unfused CPU path ignores the lists and applies mask_mod
everywhere, so `tests/attention/test_flex_attention.py` checks the lists themselves against the causal rule.

Decodes (q_len 1) go in one call with one batch row per sequence (flex's decoding kernel on CUDA); each
prefill chunk (with or without cached context) goes in its own call. Everything built from the step's metadata
(inverse tables, block masks) is built once per step and reused by every layer.

On CUDA the call is compiled (`torch.compile`, fused Triton kernels, dynamic shapes after the first
recompile). On CPU flex_attention runs its unfused reference path, which scores the whole physical cache
with `mask_mod` (correct, and what the tests check, but slow): the engine's `auto` backend keeps the C
kernel / SDPA path there.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from sluice.kvcache.transfer import to_device

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - torch too old
    BlockMask = flex_attention = None

# flex's sparse query tile; q lengths are not padded to it (the mask's q length is the real one).
Q_BLOCK = 128
# Triton's dot needs tiles of at least 16: smaller engine blocks cannot be a KV tile on CUDA.
MIN_CUDA_BLOCK_SIZE = 16
# The KV tile when Inductor's own flex configs cannot be read (its internals moved): one every dtype fits.
FALLBACK_BLOCK_N = 32


def available(device: torch.device, block_size: int) -> bool:
    """Whether this path can run here: flex_attention importable, and on CUDA a block size Triton can tile."""
    if flex_attention is None:
        return False
    return device.type != "cuda" or block_size >= MIN_CUDA_BLOCK_SIZE


@dataclass(slots=True)
class FlexGroup:
    """Sequences attended in one flex call: one batch row each, q_len queries per row."""

    rows: torch.Tensor | slice  # their query rows in the packed batch, row-major [num_seqs * q_len]
    num_seqs: int
    q_len: int
    tables: torch.Tensor  # [num_seqs, max_blocks] int32 physical block ids (padding: 0, masked)
    num_blocks: list[int]  # blocks per sequence, host
    q_start: torch.Tensor  # [num_seqs] int32: logical position of each row's first query (kv_len - q_len)
    q_starts: list[int] = field(default_factory=list)  # the same, on the host
    logical: torch.Tensor | None = None  # [num_seqs, num_physical_blocks] int32, built on first use
    masks: dict = field(default_factory=dict)  # sliding window -> BlockMask


def plan_groups(query_lens: list[int], seq_lens: list[int], cu_q: list[int], block_tables: torch.Tensor,
                block_size: int) -> list[FlexGroup]:
    """Decodes together, each prefill alone; host lengths only, so planning needs no device sync."""
    device = block_tables.device
    groups = []
    decode_idx = [i for i, n in enumerate(query_lens) if n == 1]
    singles = [[i] for i, n in enumerate(query_lens) if n > 1]
    for idx in ([decode_idx] if decode_idx else []) + singles:
        q_len = query_lens[idx[0]]
        num_blocks = [-(-seq_lens[i] // block_size) for i in idx]
        contiguous = idx[-1] - idx[0] == len(idx) - 1
        seq_index = slice(idx[0], idx[-1] + 1) if contiguous else to_device(idx, torch.long, device)
        if q_len > 1:
            rows = slice(cu_q[idx[0]], cu_q[idx[0]] + q_len)
        elif contiguous and cu_q[idx[-1]] - cu_q[idx[0]] == len(idx) - 1:
            rows = slice(cu_q[idx[0]], cu_q[idx[-1]] + 1)
        else:
            rows = to_device([cu_q[i] for i in idx], torch.long, device)
        groups.append(FlexGroup(
            rows=rows, num_seqs=len(idx), q_len=q_len, tables=block_tables[seq_index, : max(num_blocks)],
            num_blocks=num_blocks,
            q_start=to_device([seq_lens[i] - q_len for i in idx], torch.int32, device),
            q_starts=[seq_lens[i] - q_len for i in idx],
        ))
    return groups


def _inverse_tables(group: FlexGroup, num_physical: int, block_size: int) -> torch.Tensor:
    """logical[b, p] = index of physical block p in sequence b's table, -1 if p is not one of its blocks."""
    device = group.tables.device
    width = group.tables.shape[1]
    valid = torch.arange(width, device=device) < to_device(group.num_blocks, torch.long, device)[:, None]
    # Padding entries land in an extra column that is cut off afterwards.
    target = torch.where(valid, group.tables.long(), num_physical)
    logical = torch.full((group.num_seqs, num_physical + 1), -1, dtype=torch.int32, device=device)
    source = torch.arange(width, dtype=torch.int32, device=device).expand(group.num_seqs, width)
    return logical.scatter_(1, target, source)[:, :num_physical].contiguous()


def build_block_mask(group: FlexGroup, num_physical: int, block_size: int, window: int | None):
    """The BlockMask of one group over the physical cache: each row visits only its own blocks."""
    if group.logical is None:
        group.logical = _inverse_tables(group, num_physical, block_size)
    logical, q_start = group.logical, group.q_start

    def mask_mod(b, h, q_idx, kv_idx):
        block = logical[b, kv_idx // block_size]
        pos_k = block * block_size + kv_idx % block_size
        pos_q = q_start[b] + q_idx
        visible = (block >= 0) & (pos_k <= pos_q)
        if window is not None:
            visible = visible & (pos_k > pos_q - window)
        return visible

    device = group.tables.device
    partial, full = _tile_blocks(group, block_size, window)
    counts = to_device([[len(t) for t in row] for row in partial] + [[len(t) for t in row] for row in full],
                       torch.int32, device)
    b, num_q_blocks = group.num_seqs, len(partial[0])
    width = max(1, max(len(t) for rows in (partial, full) for row in rows for t in row))
    listed = to_device([[t + [0] * (width - len(t)) for t in row] for row in partial + full], torch.long, device)
    # Logical block indices -> physical ids through the block tables, on the device.
    tables = group.tables.long().repeat(2, 1)
    physical = tables.gather(1, listed.view(2 * b, -1)).view(2 * b, 1, num_q_blocks, width).to(torch.int32)
    # As in torch's PagedAttention, the index rows are as wide as the physical cache (the compiled kernels check
    # that the mask covers the whole KV length); only the first kv_num_blocks entries of a row are read.
    indices = torch.zeros(2 * b, 1, num_q_blocks, num_physical, dtype=torch.int32, device=device)
    indices[..., :width] = physical
    counts = counts.view(2 * b, 1, num_q_blocks)
    return BlockMask.from_kv_blocks(
        counts[:b], indices[:b], counts[b:], indices[b:], BLOCK_SIZE=(Q_BLOCK, block_size), mask_mod=mask_mod,
        seq_lengths=(group.q_len, num_physical * block_size), compute_q_blocks=False,
    )


def _tile_blocks(group: FlexGroup, block_size: int, window: int | None):
    """Per row and query tile, the logical blocks the tile sees in part (mask_mod decides slot by slot) and in
    full (no mask_mod): blocks wholly before every query of the tile and, with a window, wholly inside it.
    Blocks the tile cannot see at all are left out. Host arithmetic on the step's lengths only."""
    partial, full = [], []
    for start, n_blocks in zip(group.q_starts, group.num_blocks, strict=True):
        row_partial, row_full = [], []
        for first in range(0, group.q_len, Q_BLOCK):
            q_min, q_max = start + first, start + min(first + Q_BLOCK, group.q_len) - 1
            hi = min(n_blocks, q_max // block_size + 1)  # blocks holding a position <= q_max
            lo = 0 if window is None else max(0, (q_min - window + 1) // block_size)
            full_hi = min(hi, (q_min + 1) // block_size)  # every slot <= q_min
            full_lo = lo if window is None else max(lo, -(-(q_max - window + 1) // block_size))
            if full_lo >= full_hi:
                full_lo = full_hi = hi
            row_full.append(list(range(full_lo, full_hi)))
            row_partial.append(list(range(lo, full_lo)) + list(range(full_hi, hi)))
        partial.append(row_partial)
        full.append(row_full)
    return partial, full


# Compiled entries per code object: (dtype, head shape, decode/prefill, static/dynamic) multiply quickly, and
# past the limit dynamo would silently run flex's unfused path, which scores the whole physical cache.
RECOMPILE_LIMIT = 64


@lru_cache(maxsize=1)
def _compiled_flex():
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), RECOMPILE_LIMIT))
    return torch.compile(flex_attention, dynamic=None)


@lru_cache(maxsize=64)
def kernel_options(block_size: int, dtype: torch.dtype, head_dim: int, prefill: bool) -> dict:
    """CUDA kernel options whose tiles divide the BlockMask's (Q_BLOCK x block_size), which Inductor requires.

    BLOCK_N (the KV tile): Inductor's default for this GPU, dtype and head size, shrunk to the block size (on an
    H100/H200, bf16 with head_dim 64 defaults to 128 x 128 tiles: --block-size 64 would not compile). Both are
    powers of two, so the smaller divides the larger; never larger than the default, so never more shared memory.
    BLOCK_M (the query tile) is left to Inductor: the main kernel's defaults are powers of two up to 128, which
    divide Q_BLOCK, and forcing it would also set the decoding kernel's tile. That kernel packs q_len x (query
    heads per KV head) rows into BLOCK_M, which past Q_BLOCK divides nothing: prefill chunks (q_len > 1) are kept
    on the main kernel, and decodes (q_len 1) on the decoding kernel."""
    options: dict = {"BLOCK_N": min(block_size, _inductor_block_n(dtype, head_dim))}
    if prefill:
        options["FORCE_USE_FLEX_ATTENTION"] = True
    return options


def _inductor_block_n(dtype: torch.dtype, head_dim: int) -> int:
    """The smallest KV tile among Inductor's flex configs (forward and decoding) for this shape on this GPU."""
    try:
        from torch._inductor.choices import InductorChoices

        choices = InductorChoices()
        tiles = [c.block_n for c in choices.get_flex_attention_fwd_configs(head_dim, dtype, "cuda")]
        tiles += [c.block_n for c in choices.get_flex_decode_configs(head_dim, dtype, "cuda")]
        return min(tiles)
    except Exception:  # torch internals differ from 2.11's: a tile every dtype and head size fits
        return FALLBACK_BLOCK_N


def flex_paged_attention(query, key_cache, value_cache, groups: list[FlexGroup], block_size: int, scale: float,
                         window: int | None, softcap: float | None) -> torch.Tensor:
    """query [T, H, D] (new K/V already written) → output [T, H, D], one flex call per group."""
    num_physical, _, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    # [1, Hkv, num_physical * block_size, D]: a strided view of the cache, no copy.
    k = key_cache.view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = value_cache.view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
    score_mod = None
    if softcap:
        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)
    attend = _compiled_flex() if query.is_cuda else flex_attention
    out = torch.empty_like(query) if len(groups) > 1 or groups[0].num_seqs * groups[0].q_len != len(query) else None
    for group in groups:
        mask = group.masks.get(window)
        if mask is None:
            mask = group.masks[window] = build_block_mask(group, num_physical, block_size, window)
        q = query[group.rows].view(group.num_seqs, group.q_len, num_heads, head_dim).transpose(1, 2)
        options = kernel_options(block_size, query.dtype, head_dim, group.q_len > 1) if query.is_cuda else None
        with warnings.catch_warnings():  # off CUDA the unfused path is the point: no advice to compile it
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            o = attend(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale,
                       enable_gqa=num_heads != num_kv_heads, kernel_options=options)
        o = o.transpose(1, 2).reshape(-1, num_heads, head_dim)
        if out is None:
            return o
        out[group.rows] = o
    return out
