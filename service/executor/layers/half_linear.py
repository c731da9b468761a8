"""Linears on 16-bit weights times float32 activations (`--quantization f16 | bf16`).

Decoding streams every weight once a step, so its speed is the bytes it reads: a float16 or bfloat16 weight holds
half of float32's. The arithmetic stays float32's and only the weights are rounded (for a checkpoint published in
bf16, as most are, `bf16` keeps them exactly). A weight is kept in blocks of 64 output columns, [ceil(N / 64), K,
64] (`pack_half`), the layout float32's packed GEMV reads: calls of up to `max_rows` rows run that kernel on it
(csrc/packed_linear.cpp's packed_linear_half, also the fused layer's), each element widened in registers, a block's
columns summed in registers over all of K; larger calls widen the weight into a float32 scratch, up to
SCRATCH_ELEMENTS at a time, and multiply it in oneDNN's GEMM (bench/results/half-linear.json times them against
float32's paths). The embedding looks its rows up in the same blocks, which a tied head reads. This is the 16-bit
path of CPUs without a native bf16 matmul, where `--dtype bfloat16` would emulate it; llama.cpp's F16 files are its
counterpart.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from sluice.service.executor.layers.crossover import crossover, probe_weights
from sluice.service.executor.layers.linear import (
    Linear,
    LinearMethod,
    WeightFormat,
    onednn_linear,
    onednn_linear_available,
    pad_rows,
    set_bias,
    taking_kernel,
)

HALF_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}  # --quantization's 16-bit weight formats
BLOCK = 64  # output columns a block holds (csrc's kHalfBlock)
# A large call's float32 scratch: 16 MiB a thread, allocated once (a fresh one per call would fault in its pages
# every time). Every linear of a model up to a few billion parameters but the head fits in one piece.
SCRATCH_ELEMENTS = 1 << 22
# Row counts the crossover times: up to 64, a burst's decode steps. Coarser than crossover.py's below 16 (there the
# widened GEMM converts a whole weight for a few rows, a loss the GEMV's one read cannot match) and not past 64:
# each step timed costs start-up time (11 s for SmolLM2-135M's five shapes with every step up to 128 rows, 5 s now).
ROW_STEPS = (1, 8, 16, 24, 32, 48, 64)
_scratch = threading.local()


def scratch() -> torch.Tensor:
    """This thread's float32 scratch of SCRATCH_ELEMENTS."""
    if not hasattr(_scratch, "tensor"):
        _scratch.tensor = torch.empty(SCRATCH_ELEMENTS)
    return _scratch.tensor


def pack_half(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (16-bit) → its blocks [ceil(N / 64), K, 64], the last one zero-padded."""
    n, k = weight.shape
    blocks = -(-n // BLOCK)
    padded = weight if n == blocks * BLOCK else torch.cat([weight, weight.new_zeros(blocks * BLOCK - n, k)])
    return padded.reshape(blocks, BLOCK, k).transpose(1, 2).contiguous()


def unpack_half(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The [n, K] weight of `pack_half`'s blocks."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n]


def widened_linear(x: torch.Tensor, packed: torch.Tensor, n_out: int) -> torch.Tensor:
    """x [M, K] float32 @ W.T for W in `pack_half`'s blocks: pieces of whole blocks widened into the scratch as
    plain rows, each multiplied in oneDNN (rows padded as PlainMethod pads them: oneDNN builds a kernel per shape)."""
    k = packed.shape[1]
    if not onednn_linear_available():
        return F.linear(x, unpack_half(packed, n_out).float())
    rows, m = pad_rows(x, k)
    per_piece = max(1, SCRATCH_ELEMENTS // (BLOCK * k))
    out = torch.empty(m, n_out)
    for b in range(0, packed.shape[0], per_piece):
        part = packed[b:b + per_piece]
        plain = scratch()[:part.numel()].view(part.shape[0], BLOCK, k).copy_(part.transpose(1, 2)).view(-1, k)
        n0 = b * BLOCK
        n1 = min(n_out, n0 + plain.shape[0])
        out[:, n0:n1] = onednn_linear(rows, plain, None)[:m, :n1 - n0]
    return out


@functools.cache
def half_max_rows(dtype: torch.dtype, shape: tuple[int, int], kernel) -> int:
    """The most rows a call may have on the packed GEMV here for a `dtype` weight of `shape` [N, K] (0: the widened
    GEMM always wins), timed once per dtype and shape (crossover.py)."""
    probes = probe_weights(shape, dtype)
    n = probes[0].shape[0]  # a large weight's probes may hold fewer rows (whole blocks of 64)
    packs = [pack_half(w) for w in probes]
    del probes
    limit = crossover(lambda x: [kernel.packed_linear_half(x, p, n) for p in packs],
                      lambda x: [widened_linear(x, p, n) for p in packs], shape[1], torch.float32, steps=ROW_STEPS)
    _scratch.__dict__.pop("tensor", None)  # the loading thread's: a server decodes on its engine thread, with its own
    return limit


class HalfMethod(LinearMethod):
    """The weight in 16 bits (float16 or bfloat16), in `pack_half`'s blocks (`layer.packed`), float32 arithmetic.
    `kernel`: the built extension (None: every call widened into the scratch)."""

    def __init__(self, half: torch.dtype, kernel=None) -> None:
        self.half, self.kernel = half, kernel

    def __deepcopy__(self, memo: dict) -> HalfMethod:
        return copy.copy(self)  # no tensors here (the layer holds them); the extension module is shared

    def create_weights(self, layer, weight, bias):
        layer.register_buffer("packed", pack_half(weight.to(self.half)))
        set_bias(layer, None if bias is None else bias.float())
        n, k = weight.shape
        self.max_rows = half_max_rows(self.half, (n, k), self.kernel) if self.kernel is not None else 0
        return n, k

    def apply(self, layer, rows):
        x = rows.float()
        if x.shape[0] <= self.max_rows:
            out = self.kernel.packed_linear_half(x, layer.packed, layer.out_features)
        else:
            out = widened_linear(x, layer.packed, layer.out_features)
        if layer.bias is not None:
            out += layer.bias
        return out.to(rows.dtype)

    def dense_weight(self, layer):
        return unpack_half(layer.packed, layer.out_features).float()

    def rows_at(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` (int64 [n]) in 16 bits [n, K]: an embedding's lookup."""
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < layer.out_features:  # as F.embedding refuses
            raise IndexError(f"row ids out of range for {layer.out_features} rows")
        return layer.packed[ids // BLOCK, :, ids % BLOCK]

    def layer_op(self, layer):
        if self.kernel is None or not self.max_rows:
            return None
        return self.kernel.LayerLinear(layer.packed, layer.out_features, layer.bias)

    def describe(self, layer):
        name = "f16" if self.half == torch.float16 else "bf16"
        return f"{name} weights, GEMV up to {self.max_rows} rows" if self.max_rows else f"{name} weights"


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
        self.row_limits = Counter()  # the linears' max_rows
        self.name = f"{name} (16-bit weights, float32 arithmetic)"

    def make(self, weight, bias, parts, sizes, tied=False):
        linear = HalfLinear(weight, bias, self.half, self.kernel)
        self.row_limits[linear.method.max_rows] += 1
        return linear

    def make_parts(self, weights, biases, parts, device, dtype):
        # Rounded part by part: a fused weight never exists in float32 as well.
        weight = torch.cat([w.detach().to(device=device, dtype=self.half) for w in weights]) if len(weights) > 1 \
            else weights[0].detach().to(device=device, dtype=self.half)
        bias = None if biases[0] is None else torch.cat(biases).to(device=device, dtype=torch.float32)
        return self.make(weight, bias, parts, [w.shape[0] for w in weights])

    def embedding(self, weight, device, dtype):
        return HalfEmbedding(weight.detach().to(device=device, dtype=self.half), self.half, self.kernel)

    def tied_head(self, embed):
        self.row_limits[embed.table.method.max_rows] += 1
        return embed.table

    def describe(self) -> str:
        gemv = taking_kernel(self.row_limits)
        return self.name + (f", GEMV: {gemv} (rows: linears)" if gemv else "")
