"""Linears and embeddings on GGUF's own blocks, kept as the file stores them (uint8 rows, no float copy).

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32 inputs a block) and the K-quants Q4_K, Q5_K, Q6_K (256). Calls of few rows
(decoding) run csrc/gguf_linear.cpp's integer GEMV on the blocks in place, the activations rounded to int8 per 32
inputs as llama.cpp does; larger calls (prefill) dequantize a tile of output rows at a time into a scratch and
multiply, so no float copy of a weight outlives its call. Without the native build, `dequantize` below (pure
torch, also the tests' reference) does the tiles for every call.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from sluice.service.engine.layers.linear import LinearMethod, PlainLinear

# GGML type name → (type id, elements per block, bytes per block), as gguf.GGML_QUANT_SIZES has them.
BLOCK_TYPES = {
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210),
}
# One Zen 4 core, a SmolLM2 down_proj (576 x 1536) in Q4_K / Q6_K, Q8_0 gate_proj (1536 x 576): the integer GEMV
# takes 0.06 / 0.07 / 0.05 ms at 1 row, 0.83 / 0.87 / 0.72 at 32; dequantized tiles + GEMM 0.47 / 0.48 / 0.38 and
# 1.11 / 1.13 / 1.01.
KERNEL_MAX_ROWS = 32
TILE_ELEMENTS = 1 << 18  # a prefill tile's float scratch: 1 MiB


@dataclass(slots=True)
class GgufBlocks:
    """A weight as a GGUF file stores it: `data` uint8 [N, row_bytes], each row its K / QK blocks of `qtype`."""

    data: torch.Tensor
    qtype: str
    in_features: int


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes → [..., 2n]: the low nibbles, then the high ones."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """[nb, 4] bytes → [nb, 32]: bit j of the little-endian 32-bit word."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh[:, :, None] >> shifts) & 1).reshape(-1, 32)


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes → eight 6-bit scales and minimums [nb, 8]."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    minimum = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return scale.float(), minimum.float()


def _dequantize_blocks(b: torch.Tensor, qtype: str) -> torch.Tensor:
    """Blocks [nb, bytes] → float32 [nb, QK]."""
    if qtype == "Q8_0":
        return _f16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()
    if qtype in ("Q4_0", "Q4_1"):
        q = _nibbles(b[:, 2 if qtype == "Q4_0" else 4:]).float()
        return _f16(b, 0) * (q - 8) if qtype == "Q4_0" else _f16(b, 0) * q + _f16(b, 2)
    if qtype in ("Q5_0", "Q5_1"):
        head = 2 if qtype == "Q5_0" else 4
        q = (_nibbles(b[:, head + 4:]) | (_bits32(b[:, head:head + 4]) << 4)).float()
        return _f16(b, 0) * (q - 16) if qtype == "Q5_0" else _f16(b, 0) * q + _f16(b, 2)
    if qtype in ("Q4_K", "Q5_K"):
        scale, minimum = _k4_scales(b[:, 4:16])
        qs = b[:, 48:] if qtype == "Q5_K" else b[:, 16:]
        q = _nibbles(qs.reshape(-1, 4, 32)).reshape(-1, 8, 32)  # sub-block 2j: chunk j's low nibbles, 2j+1 high
        if qtype == "Q5_K":
            q = q | (((b[:, 16:48, None] >> torch.arange(8, dtype=torch.uint8)) & 1).transpose(1, 2) << 4)
        d = _f16(b, 0)[:, :, None] * scale[:, :, None]
        return (d * q.float() - _f16(b, 2)[:, :, None] * minimum[:, :, None]).reshape(-1, 256)
    if qtype == "Q6_K":
        ql = _nibbles(b[:, :128].reshape(-1, 2, 64))  # [nb, 2, 128]
        qh = (b[:, 128:192].reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3
        q = (ql | (qh.reshape(-1, 2, 128) << 4)).float() - 32
        scale = b[:, 192:208].contiguous().view(torch.int8).float() * _f16(b, 208)
        return (scale.repeat_interleave(16, dim=-1) * q.reshape(-1, 256)).reshape(-1, 256)
    raise ValueError(f"no dequantization for GGML type {qtype}")


def dequantize(data: torch.Tensor, qtype: str, in_features: int, kernel=None) -> torch.Tensor:
    """Rows of blocks uint8 [N, row_bytes] → float32 [N, in_features]; in C++ where `kernel` is the built ops."""
    if kernel is not None:
        return kernel.gguf_dequantize(data, BLOCK_TYPES[qtype][0], in_features)
    _, _, nbytes = BLOCK_TYPES[qtype]
    return _dequantize_blocks(data.reshape(-1, nbytes), qtype).reshape(data.shape[0], in_features)


class GgufLinear(nn.Module):
    """y = x W^T + b with W in GGUF blocks as stored; float activations in and out (computed in float32)."""

    def __init__(self, blocks: GgufBlocks, bias: torch.Tensor | None = None, kernel=None) -> None:
        super().__init__()
        _, qk, nbytes = BLOCK_TYPES[blocks.qtype]
        self.in_features, self.out_features = blocks.in_features, blocks.data.shape[0]
        if self.in_features % qk or blocks.data.shape[1] != self.in_features // qk * nbytes:
            raise ValueError(f"{blocks.qtype} rows of {blocks.data.shape[1]} bytes for {self.in_features} inputs")
        self.qtype, self.type_id = blocks.qtype, BLOCK_TYPES[blocks.qtype][0]
        self.register_buffer("blocks", blocks.data)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.kernel = kernel  # native.load(), or None: every call dequantizes tiles in torch
        self.tile_rows = max(16, TILE_ELEMENTS // self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] → [..., N]."""
        rows = x.reshape(-1, self.in_features).float()
        if self.kernel is not None and rows.shape[0] <= KERNEL_MAX_ROWS:
            out = self.kernel.gguf_linear(rows, self.blocks, self.type_id)
        else:
            out = torch.empty(rows.shape[0], self.out_features)
            for n in range(0, self.out_features, self.tile_rows):
                tile = dequantize(self.blocks[n:n + self.tile_rows], self.qtype, self.in_features, self.kernel)
                torch.mm(rows, tile.t(), out=out[:, n:n + tile.shape[0]])
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [N, K] the blocks stand for (tests and references only)."""
        return dequantize(self.blocks, self.qtype, self.in_features)

    def extra_repr(self) -> str:
        kernel = ", integer GEMV" if self.kernel is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.qtype}{kernel}"


class GgufEmbedding(nn.Module):
    """Token embeddings in GGUF blocks: only the looked-up rows are dequantized, into `dtype`."""

    def __init__(self, blocks: GgufBlocks, dtype: torch.dtype, kernel=None) -> None:
        super().__init__()
        self.qtype, self.embedding_dim, self.dtype, self.kernel = blocks.qtype, blocks.in_features, dtype, kernel
        self.register_buffer("blocks", blocks.data)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] → [..., E]."""
        rows = self.blocks.index_select(0, ids.reshape(-1))
        out = dequantize(rows, self.qtype, self.embedding_dim, self.kernel).to(self.dtype)
        return out.view(*ids.shape, self.embedding_dim)


class MergedLinear(nn.Module):
    """Linears of one input side by side whose formats differ (a GGUF may store q and v in different types)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The parts' outputs concatenated along the last dim."""
        return torch.cat([part(x) for part in self.parts], dim=-1)


class GgufBlockMethod(LinearMethod):
    """Each linear in its GGUF file's block type as stored; q/k/v and gate/up fused where their types match (else
    side by side), float tensors (F32, F16) plain; the embedding in blocks, a tied head reading the same bytes."""

    def __init__(self, dtype: torch.dtype, kernel=None) -> None:
        self.dtype, self.kernel, self.made = dtype, kernel, Counter()
        self.name = "GGUF blocks as stored" + (" (integer GEMV)" if kernel is not None else " (torch dequantize)")

    def make(self, weight, bias, parts, sizes, tied=False):
        return self.make_parts([weight], [bias], parts, weight.device, self.dtype)

    def make_parts(self, weights, biases, parts, device, dtype):
        kinds = [w.qtype if isinstance(w, GgufBlocks) else "float" for w in weights]
        if len(set(kinds)) > 1:
            return MergedLinear([self.make_parts([w], [b], [p], device, dtype)
                                 for w, b, p in zip(weights, biases, parts, strict=True)])
        bias = None if biases[0] is None else torch.cat(biases).float()
        self.made[kinds[0]] += 1
        if kinds[0] == "float":
            return PlainLinear(torch.cat(weights).to(dtype), None if bias is None else bias.to(dtype), pad=True)
        data = torch.cat([w.data for w in weights]) if len(weights) > 1 else weights[0].data
        return GgufLinear(GgufBlocks(data, kinds[0], weights[0].in_features), bias, self.kernel)

    def embedding(self, weight, device, dtype):
        if isinstance(weight, GgufBlocks):
            return GgufEmbedding(weight, dtype, self.kernel)
        return super().embedding(weight, device, dtype)

    def tied_head(self, embed):
        if isinstance(embed, GgufEmbedding):
            self.made[embed.qtype] += 1
            return GgufLinear(GgufBlocks(embed.blocks, embed.qtype, embed.embedding_dim), None, self.kernel)
        return super().tied_head(embed)

    def describe(self) -> str:
        return f"{self.name}: {dict(self.made)} (type: linears)"
