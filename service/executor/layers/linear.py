"""The one linear layer and its methods (vLLM's LinearMethod: one layer class, the format in the method).

`Linear` is every projection of the owned model: y = x W^T + b with W kept in its `method`'s format. A
`LinearMethod` declares what a format does: `create_weights` registers its tensors on the layer, `apply` multiplies,
`kernel_facts` tells csrc/llama_layer.cpp the few-row C++ kernel it may call (`KernelFacts`: the op, the most rows
it takes, its dtype), `dense_weight` gives the float weight back. The methods:

- `PlainMethod` (here): the weight as it is; on CPU row counts padded for oneDNN and, where the C++ GEMV beats it
  (`decode_kernel_wins`), few-row calls in it. On CUDA, or without a compiler: torch's own linear.
- `packed_linear.PackedMethod`: oneDNN-prepacked weights, few-row calls in the packed-layout GEMV.
- `gguf_linear.GgufMethod`: GGUF blocks of one quant type (quant_types.py); `gguf_linear.MergedMethod`: parts of
  one input in different formats side by side (a GGUF file may store q and v in different types).

A `WeightFormat` (chosen by `--quantization` / `--prepack-weights`, or a .gguf file) makes the model's linears, fused
ones included (q/k/v, gate/up: one weight, one call), its embedding and a head tied to it. PlainLinear, PackedLinear,
GgufLinear and MergedLinear are Linear with the method named: constructors (callers type-check by them), no
behaviour of their own.
"""

from __future__ import annotations

import copy
import functools
import logging
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sluice import native
from sluice.service.executor.layers.crossover import crossover, kept_limit, probe_weights

logger = logging.getLogger("sluice.engine")


@dataclass(frozen=True, slots=True)
class KernelFacts:
    """What a linear's few-row C++ kernel is to csrc/llama_layer.cpp: `op` its LayerLinear (None: no kernel the
    layer object can call), `max_rows` the most rows a call may have on it, `dtype` what it computes in."""

    op: object | None
    max_rows: int
    dtype: torch.dtype


class LinearMethod(ABC):
    """One weight format of one Linear: the layer holds the tensors (so state_dict, .to() and copies see them), the
    method what they mean. `max_rows`: the most rows a call may have on the format's few-row kernel (0: never)."""

    max_rows: int = 0
    dtype: torch.dtype = torch.float32  # what the few-row kernel computes in

    @abstractmethod
    def create_weights(self, layer: Linear, weight, bias: torch.Tensor | None) -> tuple[int, int]:
        """Register on `layer` the tensors standing for `weight` (and its bias, `layer.bias`); (out, in) features."""

    @abstractmethod
    def apply(self, layer: Linear, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, K] → [M, N] in the rows' dtype, the bias added."""

    @abstractmethod
    def dense_weight(self, layer: Linear) -> torch.Tensor:
        """The weight [N, K] as float values (a copy where the format is not plain)."""

    def layer_op(self, layer: Linear):
        """csrc/llama_layer.cpp's LayerLinear for this layer's kernel, its bias included, or None (no such kernel)."""
        return None

    def kernel_facts(self, layer: Linear) -> KernelFacts:
        """The layer's kernel facts (KernelFacts)."""
        return KernelFacts(self.layer_op(layer), self.max_rows, self.dtype)

    def rebuilt(self, layer: Linear) -> Linear | None:
        """A copy of `layer` built afresh where its tensors cannot be deep-copied (None: a plain deep copy)."""
        return None

    def describe(self, layer: Linear) -> str:
        """What the layer's repr says of the format."""
        return ""


def check_row_ids(ids: torch.Tensor, rows: int) -> None:
    """IndexError where `ids` (an embedding's lookup) falls outside [0, rows), as index_select and F.embedding refuse
    them: a gather from a packed layout would read another row, or past the buffer."""
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < rows:
        raise IndexError(f"row ids out of range for {rows} rows")


def set_bias(layer: nn.Module, bias: torch.Tensor | None) -> None:
    """Register `bias` on `layer` as its frozen `bias` parameter (None: no bias)."""
    layer.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=False))


class Linear(nn.Module):
    """y = x W^T + b, W in `method`'s format (LinearMethod)."""

    def __init__(self, method: LinearMethod, weight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.method = method
        self.out_features, self.in_features = method.create_weights(self, weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] → [..., N]."""
        out = self.method.apply(self, x.reshape(-1, self.in_features))
        return out.view(*x.shape[:-1], self.out_features)

    def kernel_facts(self) -> KernelFacts:
        """The few-row C++ kernel this linear offers csrc/llama_layer.cpp."""
        return self.method.kernel_facts(self)

    def dense_weight(self) -> torch.Tensor:
        """The weight [N, K] as float values."""
        return self.method.dense_weight(self)

    def __deepcopy__(self, memo: dict) -> Linear:
        rebuilt = self.method.rebuilt(self)
        if rebuilt is not None:
            return rebuilt
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return copied

    def extra_repr(self) -> str:
        described = self.method.describe(self)
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}" + (
            f", {described}" if described else "")


PACK_BATCH_HINT = 64  # oneDNN picks its blocking for this many rows; any row count still works


def padded_rows(m: int) -> int:
    """Row count rounded up to one of a few sizes (1, 2, 4, 8, 16, then multiples of 16, 64, 256).

    oneDNN builds and caches a kernel for every distinct input shape, about half a MiB each; a step's token
    count takes hundreds of values, so unpadded the cache would grow by hundreds of MiB, evict, and rebuild.
    Padding keeps it to a few dozen kernels; the common shapes (decode batches of 1, 16, 64, full token
    budgets) need no padding at all.
    """
    if m <= 16:
        return 1 << max(0, m - 1).bit_length()
    step = 16 if m <= 128 else 64 if m <= 512 else 256
    return -(-m // step) * step


def pad_rows(x: torch.Tensor, in_features: int) -> tuple[torch.Tensor, int]:
    """x as a 2-D batch of rows, zero-padded to `padded_rows`, and the real row count."""
    rows = x.reshape(-1, in_features)
    m = rows.shape[0]
    pad = padded_rows(m) - m
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, in_features)])
    return rows, m


def onednn_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [M, K] @ weight.T (+ bias) in oneDNN's GEMM, on a packed weight or a plain one."""
    return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), weight, bias, "none", [], "")


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
    GEMV: torch's fp32 linear calls MKL's sgemm, which re-lays-out the weight on every call), else torch's linear."""
    return onednn_linear(rows, weight, bias) if onednn else F.linear(rows, weight, bias)


@functools.cache
def plain_max_rows(dtype: torch.dtype, shape: tuple[int, int]) -> int:
    """The most rows a call may have on the plain-layout C++ GEMV here for a weight of `shape` [N, K] (0: never),
    timed once per dtype and shape on this machine (crossover.py)."""
    if not decode_kernel_wins(dtype):
        return 0

    def measure() -> int:
        weights = probe_weights(shape, dtype)
        onednn = dtype == torch.float32
        return crossover(lambda x: [plain_gemv(x, w) for w in weights],
                         lambda x: [plain_gemm(pad_rows(x, shape[1])[0], w, None, onednn) for w in weights],
                         shape[1], dtype)

    return kept_limit(f"plain {dtype} {shape[0]}x{shape[1]}", measure)


class PlainMethod(LinearMethod):
    """The weight [N, K] as it is (`layer.weight`). On CPU (`pad`): row counts padded to `padded_rows` (oneDNN builds
    and caches a kernel per input shape); with `decode_kernel`, calls of up to `max_rows` rows in the C++ GEMV for the
    dtype and larger fp32 ones in oneDNN on the plain weight. No layer op: llama_layer.cpp reads packed layouts."""

    def __init__(self, pad: bool = False, decode_kernel: bool = False) -> None:
        self.pad, self.decode_kernel = pad, decode_kernel

    def create_weights(self, layer, weight, bias):
        layer.weight = nn.Parameter(weight, requires_grad=False)
        set_bias(layer, bias)
        self.dtype = weight.dtype
        self.max_rows = plain_max_rows(weight.dtype, tuple(weight.shape)) if self.decode_kernel else 0
        return weight.shape

    def apply(self, layer, rows):
        if not self.pad:
            return F.linear(rows, layer.weight, layer.bias)
        if rows.shape[0] <= self.max_rows and rows.dtype == layer.weight.dtype:
            out = plain_gemv(rows, layer.weight)
            if layer.bias is not None:
                out += layer.bias
            return out
        padded, m = pad_rows(rows, layer.in_features)
        return plain_gemm(padded, layer.weight, layer.bias, self.decode_kernel and rows.dtype == torch.float32)[:m]

    def dense_weight(self, layer):
        return layer.weight.detach()

    def describe(self, layer):
        return f"C++ GEMV up to {self.max_rows} rows" if self.max_rows else ""


class PlainLinear(Linear):
    """A Linear on its plain weight (PlainMethod)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pad: bool = False,
                 decode_kernel: bool = False) -> None:
        super().__init__(PlainMethod(pad, decode_kernel), weight, bias)


def taking_kernel(row_limits: Counter) -> dict[int, int]:
    """{most rows: linears} of the linears whose kernel takes some rows, from a count of their row limits."""
    return {rows: n for rows, n in row_limits.items() if rows}


class WeightFormat(ABC):
    """Makes the module serving each (possibly fused) weight of a model in one format (vLLM's quantization config:
    it picks each layer's LinearMethod)."""

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


class PlainFormat(WeightFormat):
    """Plain weights; on CPU padded rows, and the C++ decode GEMV where it wins for the dtype."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.pad = device.type == "cpu"
        self.decode_kernel = self.pad and decode_kernel_wins(dtype)
        self.row_limits = Counter()  # the plain linears' max_rows
        self.name = "plain"

    def make(self, weight, bias, parts, sizes, tied=False):
        linear = PlainLinear(weight, bias, self.pad, self.decode_kernel)
        self.row_limits[linear.method.max_rows] += 1
        return linear

    def describe(self) -> str:
        gemv = taking_kernel(self.row_limits)
        return self.name + (f", C++ GEMV: {gemv} (rows: linears)" if gemv else "")
