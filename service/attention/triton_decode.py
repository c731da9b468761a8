"""Decode attention on the paged cache in one Triton kernel: what a CUDA graph of the decode step captures.

Every shape the kernel sees depends on the step's row count only: each row's block table and kv length are read
on the device (the persistent decode buffers, `service/executor/decode_buffers.py`), and the loop over a row's
tokens runs to its own length. So one capture per batch size replays every later step of that size, whatever
its lengths; FlexAttention's block masks, built on the host per step, cannot be captured that way.

One program per (row, KV head) attends that head's query group against the row's tokens in tiles of TILE
positions, with an online softmax in float32: scores by one tensor-core dot of the group (padded to 16 rows)
against the tile's keys, then the probabilities against its values. Each token's block is looked up per
position, so a tile may span blocks of any size. float32 runs its dots in IEEE precision (no TF32): the
parity checks compare float32 greedy output token for token.

Triton is optional: `available()` says whether it runs here. On CPU, tests run the same kernel in Triton's
interpreter (TRITON_INTERPRET=1, set before `kernel()` is first built).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

TILE = 64  # kv positions a loop iteration reads
MIN_DOT = 16  # tl.dot's smallest tile side: query groups and head sizes are padded up to it
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available(device: torch.device) -> bool:
    """Whether Triton's kernels run on `device`: CUDA with Triton installed. (Tests run them on CPU in Triton's
    interpreter, whose bfloat16 dot is wrong: that is for tests to choose, per dtype.)"""
    return device.type == "cuda" and _triton_installed()


@functools.cache
def _triton_installed() -> bool:
    # Asked by every layer's norm, rotary and MLP and every step's metadata: look the package up once.
    return importlib.util.find_spec("triton") is not None


def pow2(n: int, minimum: int = MIN_DOT) -> int:
    """The smallest power of two >= n and >= minimum (Triton's block shapes)."""
    return max(minimum, 1 << (n - 1).bit_length())


@functools.cache
def kernel():
    """The jitted kernel (built on first use, so a test can turn the interpreter on first)."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["stride_tn"])  # eager steps' tables vary in width
    def paged_decode_kernel(
        Q, K, V, Tables, Lens, Out, scale, window, softcap,
        stride_qn, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_tn,
        stride_on, stride_oh,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq_len = tl.load(Lens + row).to(tl.int32)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, HEAD_DIM_P)
        t = tl.arange(0, TILE_N)
        heads = kv_head * GROUP + g
        q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
        q = tl.load(Q + row * stride_qn + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
        m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
        first = 0
        if HAS_WINDOW:  # a decode at position L - 1 sees positions L - window .. L - 1
            first = (tl.maximum(seq_len - window, 0) // TILE_N) * TILE_N
        for start in range(first, seq_len, TILE_N):
            pos = start + t
            valid = pos < seq_len
            if HAS_WINDOW:
                valid = valid & (pos >= seq_len - window)
            block = tl.load(Tables + row * stride_tn + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            offset = pos % BLOCK_SIZE
            kv_mask = valid[None, :] & (d < HEAD_DIM)[:, None]
            k_t = tl.load(K + block[None, :] * stride_kb + offset[None, :] * stride_ks + kv_head * stride_kh
                          + d[:, None], mask=kv_mask, other=0.0)  # [HEAD_DIM_P, TILE_N]
            if IEEE:
                s = tl.dot(q, k_t, input_precision="ieee")
            else:
                s = tl.dot(q, k_t.to(q.dtype))
            s = s * scale
            if HAS_SOFTCAP:  # softcap * tanh(s / softcap), tanh written with exp (no tl.tanh in every Triton)
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + block[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh
                        + d[None, :], mask=valid[:, None] & (d < HEAD_DIM)[None, :], other=0.0)  # [TILE_N, D_P]
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(Out + row * stride_on + heads[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
                 mask=q_mask)

    return paged_decode_kernel


def check_inputs(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """What both Triton attention kernels read: the head dimension contiguous, a cache of the queries' dtype."""
    if query.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the Triton attention kernels need the head dimension contiguous")
    if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype or query.dtype not in DTYPES:
        raise ValueError(f"the Triton attention kernels read a cache of the queries' dtype, not {key_cache.dtype} "
                         f"under {query.dtype}")


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int | None = None,
                 softcap: float | None = None) -> torch.Tensor:
    """query [n, H, D] (row i at position seq_lens[i] - 1, its K/V already stored) against the cache [blocks,
    block_size, Hkv, D] through block_tables [n, >= blocks a row needs] → out [n, H, D]."""
    n, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    check_inputs(query, key_cache, value_cache)
    group = num_heads // num_kv_heads
    out = torch.empty(n, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if n == 0:
        return out
    kernel()[(n, num_kv_heads)](
        query, key_cache, value_cache, block_tables, seq_lens, out, scale, window or 0, softcap or 1.0,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_P=pow2(group), HEAD_DIM=head_dim, HEAD_DIM_P=pow2(head_dim), BLOCK_SIZE=block_size,
        TILE_N=TILE, HAS_WINDOW=bool(window), HAS_SOFTCAP=bool(softcap), IEEE=query.dtype == torch.float32,
    )
    return out
