"""Linears, one class per weight format, and the linear method that picks it at load (vLLM's LinearMethod idea).

A model asks its method for each of its linears, fused ones included (q/k/v, gate/up: one weight, one call), with
the checkpoint names of the parts. The method answers with the module serving that weight in its format:

- `PlainMethod`: the weight as it is (`PlainLinear`); on CPU, row counts padded for oneDNN and, where the C++ GEMV
  wins (`decode_kernel_wins`), few-row calls in it. On CUDA, or without a compiler: torch's own linear.
- `PackedMethod`: oneDNN-prepacked weights read by the packed-layout GEMV (`packed_linear.PackedLinear`); a head
  tied to the embedding stays plain (the embedding needs the plain weight).
- `gguf_linear.GgufBlockMethod`: a .gguf file's blocks as stored (Q4_0 to Q8_0, Q4_K, Q5_K, Q6_K), read in place;
  `gguf_linear.QuantizeMethod`: a float checkpoint quantized at load into Q8_0 or Q4_1 blocks (int8, int4).
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from sluice import native
from sluice.service.engine.layers.crossover import crossover, probe_weights
from sluice.service.engine.layers.packed_linear import PackedLinear, onednn_linear, pad_rows

logger = logging.getLogger("sluice.engine")


def onednn_linear_available() -> bool:
    """Whether this torch exposes oneDNN's linear on a plain fp32 weight."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def decode_kernel_wins(dtype: torch.dtype) -> bool:
    """Whether plain weights with the C++ decode GEMV beat the alternatives for this dtype on this CPU."""
    ops = native.load()
    if ops is None:
        return False
    if dtype == torch.bfloat16:
        return ops.bf16_linear_is_native()  # the scalar fallback loses to oneDNN's bf16 path
    return dtype == torch.float32 and onednn_linear_available()  # more rows in fp32 need oneDNN on the plain weight


def plain_gemv(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows [M, K] @ weight.T in the plain-layout C++ GEMV for the weight's dtype (fp32 or bf16)."""
    ops = native.load()
    return ops.f32_linear(rows, weight) if weight.dtype == torch.float32 else ops.bf16_linear(rows, weight)


def plain_gemm(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool) -> torch.Tensor:
    """rows [M, K] @ weight.T (+ bias) for more rows: oneDNN on the plain weight where `onednn` (fp32 with the C++
    GEMV: torch's fp32 linear calls MKL's sgemm), else torch's linear."""
    return onednn_linear(rows, weight, bias) if onednn else F.linear(rows, weight, bias)


@functools.cache
def decode_kernel_max_rows(dtype: torch.dtype, shape: tuple[int, int]) -> int:
    """The most rows a call may have to take the plain-layout C++ GEMV here for a weight of `shape` [N, K] (0:
    never), timed once per dtype and shape."""
    if not decode_kernel_wins(dtype):
        return 0
    weights = probe_weights(shape, dtype)
    onednn = dtype == torch.float32
    return crossover(lambda x: [plain_gemv(x, w) for w in weights],
                     lambda x: [plain_gemm(pad_rows(x, shape[1])[0], w, None, onednn) for w in weights], shape[1],
                     dtype)


class PlainLinear(nn.Module):
    """y = x W^T + b on the plain weight [N, K]. On CPU (`pad`): row counts padded to `padded_rows` (oneDNN builds
    and caches a kernel per input shape: unpadded, a server's RSS grows by hundreds of MiB as step sizes vary). With
    `decode_kernel`: calls of up to `kernel_rows` rows (decode_kernel_max_rows) in the C++ GEMV for the dtype, larger
    fp32 ones in oneDNN on the plain weight (torch's fp32 linear calls MKL's sgemm, which re-lays-out the weight on
    every call: 1.2-1.6x slower)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pad: bool = False,
                 decode_kernel: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.pad, self.decode_kernel = pad, decode_kernel
        self.kernel_rows = decode_kernel_max_rows(weight.dtype, tuple(weight.shape)) if decode_kernel else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] → [..., N]."""
        if not self.pad:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= self.kernel_rows and x.dtype == self.weight.dtype:
            out = plain_gemv(rows, self.weight)
            if self.bias is not None:
                out += self.bias
            return out.view(*x.shape[:-1], self.out_features)
        padded, m = pad_rows(x, self.in_features)
        out = plain_gemm(padded, self.weight, self.bias, self.decode_kernel and x.dtype == torch.float32)
        return out[:m].view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = f", C++ GEMV up to {self.kernel_rows} rows" if self.kernel_rows else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{kernel}"


def taking_kernel(row_limits: Counter) -> dict[int, int]:
    """{most rows: linears} of the linears whose kernel takes some rows, from a count of their row limits."""
    return {rows: n for rows, n in row_limits.items() if rows}


class LinearMethod(ABC):
    """Makes the module serving one (possibly fused) weight in this method's format."""

    name = "plain"

    @abstractmethod
    def make(self, weight: torch.Tensor, bias: torch.Tensor | None, parts: list[str], sizes: list[int],
             tied: bool = False) -> nn.Module:
        """weight [N, K] (the parts' rows stacked, `sizes` of them each, checkpoint names `parts`); `tied`: the
        weight is the embedding's too."""

    def make_parts(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None], parts: list[str],
                   device: torch.device, dtype: torch.dtype) -> nn.Module:
        """The module for the checkpoint tensors of `parts` (stacked here: one weight, one call), copied to `device`
        and `dtype` (the source is left as it is)."""
        weight = torch.cat(weights).to(device=device, dtype=dtype) if len(weights) > 1 \
            else weights[0].detach().to(device=device, dtype=dtype, copy=True)
        bias = None if biases[0] is None else torch.cat(biases).to(device=device, dtype=dtype)
        return self.make(weight, bias, parts, [w.shape[0] for w in weights])

    def embedding(self, weight: torch.Tensor, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """The token embedding for the checkpoint's embed_tokens weight."""
        return nn.Embedding.from_pretrained(weight.detach().to(device=device, dtype=dtype, copy=True), freeze=True)

    def tied_head(self, embed: nn.Module) -> nn.Module:
        """The output head reading the embedding's own weight."""
        return self.make(embed.weight.data, None, ["lm_head"], [embed.weight.shape[0]], tied=True)

    def describe(self) -> str:
        """What the start-up log says of the model's linears."""
        return self.name


class PlainMethod(LinearMethod):
    """Plain weights; on CPU padded rows, and the C++ decode GEMV where it wins for the dtype."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.pad = device.type == "cpu"
        self.decode_kernel = self.pad and decode_kernel_wins(dtype)
        self.kernel_rows = Counter()
        self.name = "plain"

    def make(self, weight, bias, parts, sizes, tied=False):
        linear = PlainLinear(weight, bias, self.pad, self.decode_kernel)
        self.kernel_rows[linear.kernel_rows] += 1
        return linear

    def describe(self) -> str:
        gemv = taking_kernel(self.kernel_rows)
        return self.name + (f", C++ GEMV: {gemv} (rows: linears)" if gemv else "")


class PackedMethod(PlainMethod):
    """oneDNN-prepacked weights (the plain one is dropped), decode-sized calls in the packed-layout GEMV."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(device, dtype)
        self.gemv_rows = Counter()
        self.name = "prepacked for oneDNN"

    def make(self, weight, bias, parts, sizes, tied=False):
        if tied:  # a packed copy of the embedding would hold the same bytes twice
            return super().make(weight, bias, parts, sizes, tied)
        packed = PackedLinear(weight, bias)
        self.gemv_rows[packed.gemv_max_rows] += 1
        return packed

    def describe(self) -> str:
        gemv, plain = taking_kernel(self.gemv_rows), taking_kernel(self.kernel_rows)
        tied = f"; the tied head plain, C++ GEMV: {plain}" if plain else ""
        return f"{self.name}, read by the packed-layout GEMV: {gemv or 'none'} (rows: linears){tied}"
