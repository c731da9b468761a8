"""Linears on 16-bit weights times float32 activations (`--quantization f16 | bf16`).

Decoding streams every weight once a step, so its speed is the bytes it reads: a float16 or bfloat16 weight holds
half of float32's. The arithmetic stays float32's and only the weights are rounded (for a checkpoint published in
bf16, as most are, `bf16` keeps them exactly). A weight is kept in blocks of 64 output columns, [ceil(N / 64), K,
64] (`pack_half`), the layout float32's packed GEMV reads, and every call runs that kernel on it
(csrc/packed_linear.cpp's packed_linear_half, also the fused layer's): each weight vector widened in registers as it
is loaded, a block's columns summed in registers over all of K, a block read once per few input rows
(bench/results/half-linear.json times it against float32's paths: at one row about half float32's time, from 64 rows
on about its GEMM's). The embedding looks its rows up in the same blocks, which a tied head runs. This is the 16-bit
path of CPUs without a native bf16 matmul, where `--dtype bfloat16` would emulate it; llama.cpp's F16 files are its
counterpart.
"""

from __future__ import annotations

import copy
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from sluice.service.executor.layers.linear import Linear, LinearMethod, WeightFormat, check_row_ids, set_bias

HALF_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}  # --quantization's 16-bit weight formats
BLOCK = 64  # output columns a block holds (csrc's kHalfBlock)
# The kernel takes calls of every size: past a few rows it keeps pace with oneDNN's float32 GEMM, while widening the
# weight for oneDNN cost prefills 15-30% (docs/history.md).
EVERY_CALL = 1 << 31


def pack_half(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (16-bit) → its blocks [ceil(N / 64), K, 64], the last one zero-padded."""
    n, k = weight.shape
    blocks = -(-n // BLOCK)
    padded = weight if n == blocks * BLOCK else torch.cat([weight, weight.new_zeros(blocks * BLOCK - n, k)])
    return padded.reshape(blocks, BLOCK, k).transpose(1, 2).contiguous()


def unpack_half(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The [n, K] weight of `pack_half`'s blocks."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n]


class HalfMethod(LinearMethod):
    """The weight in 16 bits (float16 or bfloat16), in `pack_half`'s blocks (`layer.packed`), float32 arithmetic.
    `kernel`: the built extension (None: every call on the weight widened by torch)."""

    def __init__(self, half: torch.dtype, kernel=None) -> None:
        self.half, self.kernel = half, kernel

    def __deepcopy__(self, memo: dict) -> HalfMethod:
        return copy.copy(self)  # no tensors here (the layer holds them); the extension module is shared

    def create_weights(self, layer, weight, bias):
        layer.register_buffer("packed", pack_half(weight.to(self.half)))
        set_bias(layer, None if bias is None else bias.float())
        self.max_rows = EVERY_CALL if self.kernel is not None else 0
        return weight.shape

    def apply(self, layer, rows):
        x = rows.float()
        if self.kernel is not None:
            out = self.kernel.packed_linear_half(x, layer.packed, layer.out_features)
        else:
            out = F.linear(x, self.dense_weight(layer))
        if layer.bias is not None:
            out += layer.bias
        return out.to(rows.dtype)

    def dense_weight(self, layer):
        return unpack_half(layer.packed, layer.out_features).float()

    def rows_at(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` (int64 [n]) in 16 bits [n, K]: an embedding's lookup."""
        check_row_ids(ids, layer.out_features)
        return layer.packed[ids // BLOCK, :, ids % BLOCK]

    def layer_op(self, layer):
        if self.kernel is None:
            return None
        return self.kernel.LayerLinear(layer.packed, layer.out_features, layer.bias)

    def describe(self, layer):
        name = "f16" if self.half == torch.float16 else "bf16"
        return f"{name} weights" + (", packed kernel" if self.kernel is not None else ", torch")


class HalfLinear(Linear):
    """A Linear on its 16-bit weight (HalfMethod)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, half: torch.dtype, kernel=None) -> None:
        super().__init__(HalfMethod(half, kernel), weight, bias)


class HalfEmbedding(nn.Module):
    """Token embeddings in 16 bits, looked up into float32 from a HalfLinear's blocks (`table`, which a tied head
    runs: one copy of the bytes)."""

    def __init__(self, weight: torch.Tensor, half: torch.dtype, kernel=None) -> None:
        super().__init__()
        self.table = HalfLinear(weight, None, half, kernel)
        self.embedding_dim = weight.shape[1]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] → [..., E] float32."""
        rows = self.table.method.rows_at(self.table, ids.reshape(-1))
        return rows.float().view(*ids.shape, self.embedding_dim)


class HalfFormat(WeightFormat):
    """`--quantization f16 | bf16`: every linear, the embedding and a head tied to it in 16 bits, float32
    arithmetic; biases and norms stay float32."""

    def __init__(self, name: str, kernel=None) -> None:
        self.half, self.kernel = HALF_DTYPES[name], kernel
        self.made = Counter()  # linears made, the tied head included
        self.name = f"{name} (16-bit weights, float32 arithmetic" + (", packed kernel)" if kernel else ", torch)")

    def make(self, weight, bias, parts, sizes, tied=False):
        self.made["linears"] += 1
        return HalfLinear(weight, bias, self.half, self.kernel)

    def make_parts(self, weights, biases, parts, device, dtype):
        # Rounded part by part: a fused weight never exists in float32 as well.
        weight = torch.cat([w.detach().to(device=device, dtype=self.half) for w in weights]) if len(weights) > 1 \
            else weights[0].detach().to(device=device, dtype=self.half)
        bias = None if biases[0] is None else torch.cat(biases).to(device=device, dtype=torch.float32)
        return self.make(weight, bias, parts, [w.shape[0] for w in weights])

    def embedding(self, weight, device, dtype):
        return HalfEmbedding(weight.detach().to(device=device, dtype=self.half), self.half, self.kernel)

    def tied_head(self, embed):
        self.made["tied head"] += 1
        return embed.table

    def describe(self) -> str:
        return f"{self.name}: {dict(self.made)}"
