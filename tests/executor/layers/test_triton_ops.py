"""The decoder layer's Triton kernels (service/executor/layers/triton_ops.py) against the eager formulas they stand
for: RMSNorm, rotary on q and k in one launch (v untouched), SiLU-and-mul. On CPU in Triton's interpreter, in
float32 and float16."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it
    pytest.skip("no GPU and Triton's interpreter off", allow_module_level=True)

from sluice.service.executor.layers import triton_ops  # noqa: E402
from sluice.service.executor.layers.rotary import RotaryEmbedding  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The interpreter casts float32 to bfloat16 by truncating, not rounding: bfloat16 only where the kernels compile.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def eager_rms_norm(x, weight, eps):
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def eager_rotary(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), -1) * sin[:, None]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 96, 576])
def test_rms_norm_is_the_eager_formula(dtype, width):
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(7, width, generator=gen) * 3).to(DEVICE, dtype)
    weight = torch.randn(width, generator=gen).to(DEVICE, dtype)
    got, want = triton_ops.rms_norm(x, weight, 1e-5), eager_rms_norm(x, weight, 1e-5)
    assert got.dtype == want.dtype and got.shape == want.shape
    # float32: the sum of squares in another order; 16-bit: at most one rounding apart
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.float(), want.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 64), (9, 3, 64), (4, 4, 96)])
def test_rotary_rotates_q_and_k_in_place_and_leaves_v(dtype, heads, kv_heads, head_dim):
    import transformers

    gen = torch.Generator().manual_seed(heads)
    qkv = torch.randn(5, heads + 2 * kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)  # strided views, as the attention layer makes them
    config = transformers.LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads)
    cos, sin = RotaryEmbedding(config, head_dim).to(DEVICE)(torch.arange(5, device=DEVICE) * 37, dtype)
    want_q, want_k, want_v = eager_rotary(q, cos, sin), eager_rotary(k, cos, sin), v.clone()
    triton_ops.rotary(q, k, cos, sin)
    assert torch.equal(v, want_v)
    if dtype == torch.float32:  # a GPU build may fuse a product and its sum (one rounding fewer than eager)
        assert torch.allclose(q, want_q, rtol=1e-6, atol=1e-6) and torch.allclose(k, want_k, rtol=1e-6, atol=1e-6)
    else:  # each product rounded to the dtype as eager rounds it: the same bits
        assert torch.equal(q, want_q) and torch.equal(k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_is_the_eager_pair(dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 2 * 1500, generator=gen).to(DEVICE, dtype)  # wider than one program's block
    want = F.silu(x[:, :1500]) * x[:, 1500:]
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(triton_ops.silu_and_mul(x).float(), want.float(), rtol=tolerance, atol=tolerance)
