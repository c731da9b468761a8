"""The decoder layer's elementwise work on CUDA as one Triton kernel each: RMSNorm, rotary on q and k, SiLU-and-mul.

Eagerly, RMSNorm is eight kernels, rotary twelve (six each for q and k) and the gated activation two: at batch 1
a layer launched ~39 kernels, and launches, not the weights, set the decode step's time even inside a CUDA
graph. Each kernel here rounds where transformers' eager formula rounds (statistics and products in float32,
each eager op's result rounded to the activations' dtype), so float32 results are the eager ones up to the
order of a sum, and 16-bit ones stay within a rounding of them. On CPU the layers keep their C++ ops.
"""

from __future__ import annotations

import functools

import torch

from sluice.service.attention.triton_decode import available, pow2


def applies(x: torch.Tensor) -> bool:
    """Whether these kernels run for `x`: a CUDA tensor with Triton installed."""
    return x.is_cuda and available(x.device)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(X, W, Out, eps, stride_x, stride_o, N: tl.constexpr, N_P: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, N_P)
        mask = cols < N
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
        normed = (x * rstd).to(Out.dtype.element_ty).to(tl.float32)  # eager: normalized, then cast back
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Out + row * stride_o + cols, (w * normed).to(Out.dtype.element_ty), mask=mask)

    @triton.jit
    def rotary_kernel(Q, K, Cos, Sin, stride_qt, stride_qh, stride_kt, stride_kh, stride_c, stride_s,
                      HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEADS_P: tl.constexpr, HALF: tl.constexpr,
                      HALF_P: tl.constexpr):
        token = tl.program_id(0)
        h = tl.arange(0, HEADS_P)  # q's heads, then k's
        i = tl.arange(0, HALF_P)
        col = i < HALF
        mask = (h < HEADS + KV_HEADS)[:, None] & col[None, :]
        ptr = tl.where((h < HEADS)[:, None], Q + token * stride_qt + h[:, None] * stride_qh,
                       K + token * stride_kt + (h[:, None] - HEADS) * stride_kh) + i[None, :]
        c1 = tl.load(Cos + token * stride_c + i, mask=col, other=0.0).to(tl.float32)[None, :]
        c2 = tl.load(Cos + token * stride_c + HALF + i, mask=col, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(Sin + token * stride_s + i, mask=col, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(Sin + token * stride_s + HALF + i, mask=col, other=0.0).to(tl.float32)[None, :]
        x1 = tl.load(ptr, mask=mask, other=0.0)
        x2 = tl.load(ptr + HALF, mask=mask, other=0.0)
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        # x * cos + rotate_half(x) * sin, each product rounded to the activations' dtype as eager does
        out1 = (a1 * c1).to(x1.dtype).to(tl.float32) + (-a2 * s1).to(x1.dtype).to(tl.float32)
        out2 = (a2 * c2).to(x1.dtype).to(tl.float32) + (a1 * s2).to(x1.dtype).to(tl.float32)
        tl.store(ptr, out1.to(x1.dtype), mask=mask)
        tl.store(ptr + HALF, out2.to(x1.dtype), mask=mask)

    @triton.jit
    def silu_mul_kernel(X, Out, stride_x, stride_o, N: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(X + row * stride_x + N + cols, mask=mask, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype).to(tl.float32)  # eager: silu rounded, then the product
        tl.store(Out + row * stride_o + cols, (act * up.to(tl.float32)).to(Out.dtype.element_ty), mask=mask)

    return rms_norm_kernel, rotary_kernel, silu_mul_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) over the last dimension of x [T, E] (rows contiguous)."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(rows, dtype=torch.promote_types(x.dtype, weight.dtype))
    if rows.shape[0]:
        n = rows.shape[-1]
        _kernels()[0][(rows.shape[0],)](rows, weight, out, eps, rows.stride(0), out.stride(0), N=n, N_P=pow2(n, 1))
    return out.view(x.shape)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, H, D] and k [T, Hkv, D] in place by cos, sin [T, D] (rotate-half, as Llama), one launch."""
    tokens, heads, dim = q.shape
    if not tokens:
        return
    half = dim // 2
    _kernels()[1][(tokens,)](q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
                             sin.stride(0), HEADS=heads, KV_HEADS=k.shape[1], HEADS_P=pow2(heads + k.shape[1], 1),
                             HALF=half, HALF_P=pow2(half, 1))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :N]) * x[..., N:] for the fused gate/up projection's output x [T, 2N]."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[-1] // 2
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = min(1024, pow2(n, 1))
        _kernels()[2][(rows.shape[0], -(-n // block))](rows, out, rows.stride(0), out.stride(0), N=n, BLOCK=block)
    return out.view(*x.shape[:-1], n)
