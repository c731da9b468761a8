"""Every sequence of a step, prompt chunks and decodes alike, attended on the paged cache in one Triton launch.

The step's queries are cut into tiles of up to BLOCK_M tokens of one sequence; one program per (tile, KV head)
attends the tile's tokens times that head's query group (BLOCK_M x GROUP rows, so a KV tile is read once for the
whole group) against the sequence's cached positions up to the tile's last query, through its block table, with
an online softmax in float32. Query i of a sequence with kv length L and q length Q sees positions
j <= L - Q + i (and j > L - Q + i - window). The tile table is host arithmetic on the step's lengths, built once
per step and shared by every layer; the kernel needs no compile beyond Triton's own, so a step's prompt chunks
cost one launch per layer whatever their number and lengths (FlexAttention compiles per shape and is called once
per chunk).

float32 runs its dots in IEEE precision (no TF32). On CPU, tests run it in Triton's interpreter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from sluice.kvcache.transfer import to_device
from sluice.service.attention.triton_decode import TILE, check_inputs, pow2

ROWS = 64  # query rows (tokens x group heads) a program holds: its share of registers
ALIGN = 4  # int32 entries in 16 bytes


@dataclass(slots=True)
class VarlenPlan:
    """The step's tiles: tile t covers queries tile_first[t] .. + block_m - 1 of sequence tile_seq[t]."""

    tile_seq: torch.Tensor  # [tiles] int32
    tile_first: torch.Tensor  # [tiles] int32
    q_start: torch.Tensor  # [seqs] int32: each sequence's first row in the packed batch
    q_lens: torch.Tensor  # [seqs] int32
    seq_lens: torch.Tensor  # [seqs] int32: kv lengths, this step's tokens included
    block_m: int


@dataclass(slots=True)
class VarlenStep:
    """A step's host lengths, and its tile tables by query group (built by the step's first layer, reused by the
    others)."""

    query_lens: list[int]
    seq_lens: list[int]
    cu_q: list[int]
    plans: dict = field(default_factory=dict)  # group -> VarlenPlan

    def plan_for(self, group: int, device: torch.device) -> VarlenPlan:
        """The tile table for query groups of `group` heads."""
        found = self.plans.get(group)
        if found is None:
            found = self.plans[group] = plan(self.query_lens, self.seq_lens, self.cu_q, group, device)
        return found


def plan(query_lens: list[int], seq_lens: list[int], cu_q: list[int], group: int,
         device: torch.device) -> VarlenPlan:
    """The tile table of a step (host lengths only: no device sync), for query groups of `group` heads."""
    block_m = max(1, ROWS // pow2(group, 1))
    seqs, firsts = [], []
    for s, n in enumerate(query_lens):
        for first in range(0, n, block_m):
            seqs.append(s)
            firsts.append(first)
    # One copy for the five arrays, each padded to 16 bytes: Triton specializes a kernel on its pointers'
    # alignment, and arrays at arbitrary offsets would compile a new variant whenever a step's counts change it.
    parts = [seqs, firsts, cu_q[: len(query_lens)], query_lens, seq_lens]
    padded = [part + [0] * (-len(part) % ALIGN) for part in parts]
    table = to_device([v for part in padded for v in part], torch.int32, device)
    tile_seq, tile_first, q_start, q_lens, kv_lens = (
        chunk[: len(part)] for chunk, part in zip(table.split([len(p) for p in padded]), parts, strict=True))
    return VarlenPlan(tile_seq, tile_first, q_start, q_lens, kv_lens, block_m)


@functools.cache
def kernel():
    """The jitted kernel (built on first use, so a test can turn the interpreter on first)."""
    import triton
    import triton.language as tl

    # The block tables' row stride is the step's widest table: not specialized on, or each width would compile.
    @triton.jit(do_not_specialize=["stride_ts"])
    def paged_varlen_kernel(
        Q, K, V, Tables, TileSeq, TileFirst, QStart, QLens, KvLens, Out, scale, window, softcap,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_ts,
        stride_ot, stride_oh,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = tl.load(TileSeq + tile)
        first = tl.load(TileFirst + tile)
        q_row0 = tl.load(QStart + seq)
        q_len = tl.load(QLens + seq)
        kv_len = tl.load(KvLens + seq)
        r = tl.arange(0, BLOCK_M * GROUP_P)
        tok = first + r // GROUP_P
        g = r % GROUP_P
        d = tl.arange(0, HEAD_DIM_P)
        t = tl.arange(0, TILE_N)
        row_ok = (tok < q_len) & (g < GROUP)
        heads = kv_head * GROUP + g
        q_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
        q = tl.load(Q + (q_row0 + tok)[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=q_mask, other=0.0)
        pos_q = kv_len - q_len + tok  # each row's logical position
        context = kv_len - q_len + first  # the tile's first query position
        hi = tl.minimum(kv_len, context + BLOCK_M)  # past the tile's last query: nothing visible
        lo = 0
        if HAS_WINDOW:
            lo = (tl.maximum(context - window + 1, 0) // TILE_N) * TILE_N
        m_i = tl.full([BLOCK_M * GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * GROUP_P], tl.float32)
        acc = tl.zeros([BLOCK_M * GROUP_P, HEAD_DIM_P], tl.float32)
        for start in range(lo, hi, TILE_N):
            pos = start + t
            in_seq = pos < hi
            block = tl.load(Tables + seq * stride_ts + pos // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
            offset = pos % BLOCK_SIZE
            k_t = tl.load(K + block[None, :] * stride_kb + offset[None, :] * stride_ks + kv_head * stride_kh
                          + d[:, None], mask=in_seq[None, :] & (d < HEAD_DIM)[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, k_t, input_precision="ieee")
            else:
                s = tl.dot(q, k_t)
            s = s * scale
            if HAS_SOFTCAP:
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
            visible = in_seq[None, :] & (pos[None, :] <= pos_q[:, None])
            if HAS_WINDOW:
                visible = visible & (pos[None, :] > pos_q[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: no NaN
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + block[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh
                        + d[None, :], mask=in_seq[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(Out + (q_row0 + tok)[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=q_mask)

    return paged_varlen_kernel


def paged_varlen(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                 step: VarlenPlan, scale: float, window: int | None = None,
                 softcap: float | None = None) -> torch.Tensor:
    """query [T, H, D] (the step's tokens packed by sequence, their K/V already stored) → out [T, H, D]."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    check_inputs(query, key_cache, value_cache)
    group = num_heads // num_kv_heads
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    tiles = step.tile_seq.shape[0]
    if tiles == 0:
        return out
    kernel()[(tiles, num_kv_heads)](
        query, key_cache, value_cache, block_tables, step.tile_seq, step.tile_first, step.q_start, step.q_lens,
        step.seq_lens, out, scale, window or 0, softcap or 1.0,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_P=pow2(group, 1), BLOCK_M=step.block_m, HEAD_DIM=head_dim, HEAD_DIM_P=pow2(head_dim),
        BLOCK_SIZE=block_size, TILE_N=TILE, HAS_WINDOW=bool(window), HAS_SOFTCAP=bool(softcap),
        IEEE=query.dtype == torch.float32,
    )
    return out
