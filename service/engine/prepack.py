"""CPU linears with oneDNN-prepacked weights.

torch's plain CPU linear goes through MKL's sgemm, which re-lays-out the weight on every call. For the batch
sizes an engine runs (1 to a few hundred rows) that repacking is a large part of the cost: on 2 AMD cores the
SmolLM2 lm_head takes 46 ms at 16 rows and 82 ms at 64 through sgemm, 18 and 35 ms with its weight packed once
for oneDNN. Packing happens once at load; the packed weight replaces the plain one, so memory does not grow. A
weight tied to the embedding is not packed (the embedding needs it plain). Decode-sized calls read the packed
layout in packed_gemv's GEMV, faster there than oneDNN's own.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from sluice.service.engine import packed_gemv

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


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN prepacking applies on CPU to fp32, and to bf16 where this CPU multiplies bf16 natively."""
    return (
        device.type == "cpu"
        and (dtype == torch.float32 or (dtype == torch.bfloat16 and packed_gemv.bf16_native()))
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """An nn.Linear whose weight is kept only in oneDNN's blocked layout (inference only).

    Calls of up to packed_gemv.MAX_ROWS rows read that layout in the C++ GEMV where gemv_layout recognised it;
    larger ones (and every call where it did not) run oneDNN's own GEMM.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            # An opaque tensor (no storage): a plain attribute, not a parameter or buffer, so state_dict,
            # .parameters() and .to() leave it alone.
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_BATCH_HINT)
        self.bias = linear.bias
        self.gemv_layout = packed_gemv.gemv_layout(self.packed, linear.weight)
        self.gemv_max_rows = packed_gemv.MAX_ROWS[linear.weight.dtype] if self.gemv_layout else 0
        self.packed_ptr = torch.ops.mkldnn.data_ptr(self.packed) if self.gemv_layout else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Same result as nn.Linear.forward, up to float32 summation order."""
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= self.gemv_max_rows:
            out = packed_gemv.gemv(rows, self.packed_ptr, self.out_features, self.gemv_layout)
            if self.bias is not None:
                out += self.bias
            return out.view(*x.shape[:-1], self.out_features)
        rows, m = pad_rows(x, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self.packed, self.bias, "none", [], "")
        return out[:m].view(*x.shape[:-1], self.out_features)

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear with the same weights."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        with torch.no_grad():
            linear.weight = nn.Parameter(self.packed.to_dense(), requires_grad=False)
            if self.bias is not None:
                linear.bias = nn.Parameter(self.bias.detach().clone(), requires_grad=False)
        return linear

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        # Opaque tensors cannot be deep-copied; repack from a dense copy instead.
        return PackedLinear(self.to_linear())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PaddedLinear(nn.Linear):
    """An nn.Linear (same weight, same state_dict) whose input row count is padded to `padded_rows`.

    For the CPU dtypes that are not prepacked (bf16, fp16) torch's linear runs oneDNN, which builds and caches a
    kernel per input shape (~0.7 MiB each for a SmolLM2-sized weight): unpadded, a server's RSS grows by
    hundreds of MiB as step sizes vary. fp32's MKL path caches nothing and needs none of this.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, m = pad_rows(x, self.in_features)
        return nn.functional.linear(rows, self.weight, self.bias)[:m].view(*x.shape[:-1], self.out_features)


def pad_rows(x: torch.Tensor, in_features: int) -> tuple[torch.Tensor, int]:
    """x as a 2-D batch of rows, zero-padded to `padded_rows`, and the real row count."""
    rows = x.reshape(-1, in_features)
    m = rows.shape[0]
    pad = padded_rows(m) - m
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, in_features)])
    return rows, m


def pad_linear_rows(model: nn.Module) -> int:
    """Make every plain nn.Linear of the model a PaddedLinear, in place (no weight is copied); returns how many."""
    targets = [m for m in model.modules() if type(m) is nn.Linear]
    for linear in targets:
        linear.__class__ = PaddedLinear
    return len(targets)


def prepack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of the model by a PackedLinear, in place; returns how many were packed.

    A head tied to the embedding stays plain: the embedding needs the plain weight, and a packed copy would hold
    the same bytes twice (+108 MiB for SmolLM2 in fp32).
    """
    embedded = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}
    return replace_linears(model, PackedLinear, skip=lambda linear: linear.weight.data_ptr() in embedded)


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module],
                    skip: Callable[[nn.Linear], bool] = lambda linear: False) -> int:
    """Replace every plain nn.Linear of the model by make(linear), in place; returns how many.

    What replaces a weight holds its own copy (packed, quantized), so the model's remaining tensors are copied
    out of the loader's file mapping too, and the original weights can go.
    """
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear and not skip(m)]
    for name, linear in targets:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, make(linear))
    if targets:
        _copy_out_of_file_mappings(model)
    return len(targets)


def _copy_out_of_file_mappings(model: nn.Module) -> None:
    # Weights loaded from safetensors are views of one memory map of the file, and the map stays while any of
    # them lives: the embedding and norms would keep every page that packing read resident (+540 MiB RSS for
    # SmolLM2). Copies of the remaining tensors let it go.
    with torch.no_grad():
        seen: set[int] = set()
        for tensor in [*model.parameters(), *model.buffers()]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                tensor.data = tensor.data.clone()


def unpack_linears(model: nn.Module) -> nn.Module:
    """Undo prepack_linears, pad_linear_rows and decode kernels in place (plain nn.Linear again); returns the model."""
    for m in model.modules():
        if isinstance(m, PaddedLinear):
            m.__class__ = nn.Linear
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, PackedLinear)]
    for name, packed in targets:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, packed.to_linear())
    return model


def stock_copy(model: nn.Module) -> nn.Module:
    """A deep copy of the model with plain linears: what transformers alone would run."""
    return unpack_linears(copy.deepcopy(model))
