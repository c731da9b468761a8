"""The few-row GEMV that reads oneDNN's prepacked weights in place (csrc/packed_linear.cpp).

oneDNN packs a linear's weight once for its own GEMM, in blocks of output columns (64 or 32, by CPU), each K rows
of the block's columns (bf16: K/2 rows of input pairs): one contiguous stream per block whose columns a GEMV keeps
in registers over all of K. Decode-sized calls read that layout here, larger ones run oneDNN's GEMM on the same
bytes: one copy serves both. The layout is oneDNN's choice (it may differ by CPU and version), so `gemv_layout`
checks it weight by weight against the plain values before the GEMV may read it; a weight whose layout does not
match stays on oneDNN alone.
"""

from __future__ import annotations

import ctypes

import torch

from sluice import native

DTYPES = (torch.float32, torch.bfloat16)
SAMPLES = 2048  # weight elements compared with the packed bytes per candidate layout


def bf16_native() -> bool:
    """Whether the bf16 GEMV runs here (AVX512_BF16): only then are bf16 weights worth packing."""
    ops = native.load()
    return ops is not None and ops.packed_linear_bf16_is_native()


def packed_bytes(packed: torch.Tensor) -> torch.Tensor:
    """The packed weight's raw buffer as a flat uint8 tensor (a view: valid while `packed` lives)."""
    ptr, size = torch.ops.mkldnn.data_ptr(packed), torch.ops.mkldnn._nbytes(packed)
    return torch.frombuffer((ctypes.c_uint8 * size).from_address(ptr), dtype=torch.uint8)


def gemv_layout(packed: torch.Tensor, weight: torch.Tensor) -> tuple[int, int] | None:
    """(column block, padded K) of `packed` when its layout is one the GEMV reads (and this CPU runs it), else None."""
    ops = native.load()
    dtype = weight.dtype
    if ops is None or dtype not in DTYPES or not hasattr(torch.ops.mkldnn, "data_ptr"):
        return None
    if dtype == torch.bfloat16 and not bf16_native():
        return None
    n_out, k_in = weight.shape
    chunk = 32 if dtype == torch.bfloat16 else ops.packed_linear_f32_chunk()
    raw = packed_bytes(packed).view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    plain = weight.detach().contiguous().view(raw.dtype)
    generator = torch.Generator().manual_seed(0)
    n = torch.cat([torch.tensor([0, n_out - 1]), torch.randint(n_out, (SAMPLES,), generator=generator)])
    k = torch.cat([torch.tensor([0, k_in - 1]), torch.randint(k_in, (SAMPLES,), generator=generator)])
    for block in (64, 128, 32, 16):
        blocks = -(-n_out // block)
        k_rows, rest = divmod(raw.numel(), blocks * block)
        if block % chunk or rest or k_rows < k_in or (dtype == torch.bfloat16 and k_rows % 2):
            continue
        if dtype == torch.bfloat16:
            at = (n // block) * block * k_rows + (k // 2) * 2 * block + 2 * (n % block) + k % 2
        else:
            at = (n // block) * block * k_rows + k * block + n % block
        if torch.equal(raw[at], plain[n, k]):
            return block, k_rows
    return None


def gemv(x: torch.Tensor, packed_ptr: int, out_features: int, layout: tuple[int, int]) -> torch.Tensor:
    """x [M, K] @ W.T for W packed at packed_ptr in `layout` (gemv_layout's answer)."""
    ops = native.load()
    run = ops.packed_linear_f32 if x.dtype == torch.float32 else ops.packed_linear_bf16
    return run(x, packed_ptr, out_features, *layout)

