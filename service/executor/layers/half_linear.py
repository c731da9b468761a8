"""Linears on 16-bit weights times float32 activations (`--quantization f16 | bf16`).

Decoding streams every weight once a step, so its speed is the bytes it reads: a float16 or bfloat16 weight holds
half of float32's. The arithmetic stays float32's and only the weights are rounded (for a checkpoint published in
bf16, as most are, `bf16` keeps them exactly): calls of up to `max_rows` rows widen each weight element in registers
(csrc/f32_linear.cpp, also the fused layer's kernel); larger ones widen the weight into a float32 scratch, up to
SCRATCH_ELEMENTS at a time, and multiply it in oneDNN's GEMM (bench/results/half-linear.json times the two against
float32's packed GEMM). This is the 16-bit path of CPUs without a native bf16 matmul, where `--dtype bfloat16` would
emulate it; llama.cpp's F16 files are its counterpart.
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


def widened_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ weight.T for a 16-bit weight: pieces of it widened into the scratch, each multiplied in
    oneDNN (rows padded as PlainMethod pads them: oneDNN builds a kernel per shape)."""
    n_out, k = weight.shape
    if not onednn_linear_available():
        return F.linear(x, weight.float())
    rows, m = pad_rows(x, k)
    piece = max(1, SCRATCH_ELEMENTS // k)
    if piece >= n_out:
        return onednn_linear(rows, scratch()[:n_out * k].view(n_out, k).copy_(weight), None)[:m]
    out = torch.empty(m, n_out)
    for n in range(0, n_out, piece):
        part = weight[n:n + piece]
        out[:, n:n + part.shape[0]] = onednn_linear(rows, scratch()[:part.numel()].view_as(part).copy_(part), None)[:m]
    return out


@functools.cache
def half_max_rows(dtype: torch.dtype, shape: tuple[int, int], kernel) -> int:
    """The most rows a call may have on the widening GEMV here for a `dtype` weight of `shape` [N, K] (0: the
    widened GEMM always wins), timed once per dtype and shape (crossover.py)."""
    weights = probe_weights(shape, dtype)
    limit = crossover(lambda x: [kernel.f32_linear(x, w) for w in weights],
                      lambda x: [widened_linear(x, w) for w in weights], shape[1], torch.float32, steps=ROW_STEPS)
    _scratch.__dict__.pop("tensor", None)  # the loading thread's: a server decodes on its engine thread, with its own
    return limit


class HalfMethod(LinearMethod):
    """The weight [N, K] in 16 bits (`layer.weight`, float16 or bfloat16), float32 arithmetic. `kernel`: the built
    extension (None: every call widened into the scratch)."""

    def __init__(self, half: torch.dtype, kernel=None) -> None:
        self.half, self.kernel = half, kernel

    def __deepcopy__(self, memo: dict) -> HalfMethod:
        return copy.copy(self)  # no tensors here (the layer holds them); the extension module is shared

    def create_weights(self, layer, weight, bias):
        layer.weight = nn.Parameter(weight.to(self.half), requires_grad=False)
        set_bias(layer, None if bias is None else bias.float())
        n, k = weight.shape
        self.max_rows = half_max_rows(self.half, (n, k), self.kernel) if self.kernel is not None else 0
        return n, k

    def apply(self, layer, rows):
        x = rows.float()
        if x.shape[0] <= self.max_rows:
            out = self.kernel.f32_linear(x, layer.weight)
        else:
            out = widened_linear(x, layer.weight)
        if layer.bias is not None:
            out += layer.bias
        return out.to(rows.dtype)

    def dense_weight(self, layer):
        return layer.weight.float()

    def layer_op(self, layer):
        if self.kernel is None or not self.max_rows:
            return None
        return self.kernel.LayerLinear(layer.weight, layer.bias)

    def describe(self, layer):
        name = "f16" if self.half == torch.float16 else "bf16"
        return f"{name} weights, GEMV up to {self.max_rows} rows" if self.max_rows else f"{name} weights"


class HalfLinear(Linear):
    """A Linear on its 16-bit weight (HalfMethod)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, half: torch.dtype, kernel=None) -> None:
        super().__init__(HalfMethod(half, kernel), weight, bias)


class HalfEmbedding(nn.Module):
    """Token embeddings kept in 16 bits (`weight`), looked up into float32; a tied head reads the same tensor."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.embedding_dim = weight.shape[1]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] → [..., E] float32."""
        return F.embedding(ids, self.weight).float()


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
        weight = torch.cat([w.detach().to(device=device, dtype=self.half) for w in weights])
        bias = None if biases[0] is None else torch.cat(biases).to(device=device, dtype=torch.float32)
        return self.make(weight, bias, parts, [w.shape[0] for w in weights])

    def embedding(self, weight, device, dtype):
        return HalfEmbedding(weight.detach().to(device=device, dtype=self.half, copy=True))

    def describe(self) -> str:
        gemv = taking_kernel(self.row_limits)
        return self.name + (f", GEMV: {gemv} (rows: linears)" if gemv else "")
