"""Paged attention through `torch.nn.attention.flex_attention`, reading KV blocks in place at the engine's block size.

The whole KV cache of a layer, [num_blocks, block_size, Hkv, D], is one long physical key/value sequence
(a view, batch 1, broadcast to every sequence). A BlockMask whose KV tile is the engine's block size lists,
for each sequence, exactly its own physical blocks (its block table), so the kernel visits only those blocks
and never gathers a sequence's history; inside a visited block `mask_mod` maps the physical slot back to its
logical position through a per-step inverse table (`logical[b, physical block]`, -1 when the block is not
the sequence's, as in torch's own `PagedAttention`) and applies the causal rule (and sliding window):
query i of a sequence with kv length L and q length Q sees logical positions j <= L - Q + i.

Decodes (q_len 1) go in one call with one batch row per sequence (flex's decoding kernel on CUDA); each
prefill chunk (with or without cached context) goes in its own call. Everything built from the step's metadata
(inverse tables, block masks) is built once per step and reused by every layer.

On CUDA the call is compiled (`torch.compile`, fused Triton kernels, dynamic shapes after the first
recompile). On CPU flex_attention runs its unfused reference path, which scores the whole physical cache
with `mask_mod` (correct, and what the tests check, but slow): the engine's `auto` backend keeps the C
kernel / SDPA path there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - torch too old
    BlockMask = flex_attention = None

# flex's sparse query tile; q lengths are not padded to it (the mask's q length is the real one).
Q_BLOCK = 128
# Triton's dot needs tiles of at least 16: smaller engine blocks cannot be a KV tile on CUDA.
MIN_CUDA_BLOCK_SIZE = 16


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
        seq_index = slice(idx[0], idx[-1] + 1) if contiguous else torch.tensor(idx, device=device)
        if q_len > 1:
            rows = slice(cu_q[idx[0]], cu_q[idx[0]] + q_len)
        elif contiguous and cu_q[idx[-1]] - cu_q[idx[0]] == len(idx) - 1:
            rows = slice(cu_q[idx[0]], cu_q[idx[-1]] + 1)
        else:
            rows = torch.tensor([cu_q[i] for i in idx], device=device)
        groups.append(FlexGroup(
            rows=rows, num_seqs=len(idx), q_len=q_len, tables=block_tables[seq_index, : max(num_blocks)],
            num_blocks=num_blocks,
            q_start=torch.tensor([seq_lens[i] - q_len for i in idx], dtype=torch.int32, device=device),
        ))
    return groups


def _inverse_tables(group: FlexGroup, num_physical: int, block_size: int) -> torch.Tensor:
    """logical[b, p] = index of physical block p in sequence b's table, -1 if p is not one of its blocks."""
    device = group.tables.device
    width = group.tables.shape[1]
    valid = torch.arange(width, device=device) < torch.tensor(group.num_blocks, device=device)[:, None]
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
    num_q_blocks = -(-group.q_len // Q_BLOCK)
    width = group.tables.shape[1]
    kv_num_blocks = torch.tensor(group.num_blocks, dtype=torch.int32, device=device)
    kv_num_blocks = kv_num_blocks[:, None, None].expand(group.num_seqs, 1, num_q_blocks).contiguous()
    # As in torch's PagedAttention, the index rows are as wide as the physical cache (the compiled kernels check
    # that the mask covers the whole KV length); only the first num_blocks entries of a row are read.
    kv_indices = torch.zeros(group.num_seqs, 1, num_q_blocks, num_physical, dtype=torch.int32, device=device)
    kv_indices[..., :width] = group.tables.to(torch.int32)[:, None, None, :]
    return BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, BLOCK_SIZE=(Q_BLOCK, block_size), mask_mod=mask_mod,
        seq_lengths=(group.q_len, num_physical * block_size), compute_q_blocks=False,
    )


@lru_cache(maxsize=1)
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=None)


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
    kernel_options = {"BLOCK_N": block_size} if query.is_cuda and block_size < 64 else None
    out = torch.empty_like(query) if len(groups) > 1 or groups[0].num_seqs * groups[0].q_len != len(query) else None
    for group in groups:
        mask = group.masks.get(window)
        if mask is None:
            mask = group.masks[window] = build_block_mask(group, num_physical, block_size, window)
        q = query[group.rows].view(group.num_seqs, group.q_len, num_heads, head_dim).transpose(1, 2)
        o = attend(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads,
                   kernel_options=kernel_options)
        o = o.transpose(1, 2).reshape(-1, num_heads, head_dim)
        if out is None:
            return o
        out[group.rows] = o
    return out
