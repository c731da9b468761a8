"""CPU linears with oneDNN-prepacked weights (`LinearMethod` "prepacked", see linear.py).

torch's plain CPU linear goes through MKL's sgemm, which re-lays-out the weight on every call. For the batch
sizes an engine runs (1 to a few hundred rows) that repacking is a large part of the cost: on 2 AMD cores the
SmolLM2 lm_head takes 46 ms at 16 rows and 82 ms at 64 through sgemm, 18 and 35 ms with its weight packed once
for oneDNN. Packing happens once at load; the plain weight is dropped, so memory does not grow. A weight tied to
the embedding is not packed (the embedding needs it plain). Decode-sized calls read the packed
layout in packed_gemv's GEMV, faster there than oneDNN's own.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from sluice import native
from sluice.service.engine import packed_gemv
from sluice.service.engine.layers.crossover import crossover, probe_weights

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

    Calls of up to gemv_max_rows rows read that layout in the C++ GEMV where gemv_layout recognised it;
    larger ones (and every call where it did not) run oneDNN's own GEMM.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            # An opaque tensor (no storage): a plain attribute, not a parameter or buffer, so state_dict,
            # .parameters() and .to() leave it alone.
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.gemv_layout = packed_gemv.gemv_layout(self.packed, weight)
        self.gemv_max_rows = gemv_max_rows(weight.dtype, tuple(weight.shape)) if self.gemv_layout else 0
        self.packed_ptr = torch.ops.mkldnn.data_ptr(self.packed) if self.gemv_layout else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Same result as nn.Linear.forward, up to float32 summation order."""
        rows = x.reshape(-1, self.in_features)
        if self.gemv_layout and rows.shape[0] <= self.gemv_max_rows:
            out = packed_gemv.gemv(rows, self.packed_ptr, self.out_features, self.gemv_layout)
            if self.bias is not None:
                out += self.bias
            return out.view(*x.shape[:-1], self.out_features)
        rows, m = pad_rows(x, self.in_features)
        return onednn_linear(rows, self.packed, self.bias)[:m].view(*x.shape[:-1], self.out_features)

    @property
    def kernel_max_rows(self) -> int:
        """The most rows kernel_op's linear takes (the GEMV's)."""
        return self.gemv_max_rows

    @property
    def kernel_dtype(self) -> torch.dtype:
        """What kernel_op's linear computes in: the packed weight's dtype."""
        return self.packed.dtype

    def kernel_op(self):
        """This linear as csrc/llama_layer.cpp's LayerLinear on the packed layout, or None (no GEMV layout, or a
        bias)."""
        ops = native.load()
        if ops is None or not self.gemv_layout or self.bias is not None:
            return None
        return ops.LayerLinear(self.packed, self.packed_ptr, *self.gemv_layout, self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The plain weight [N, K] (a copy)."""
        return self.packed.to_dense()

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        # Opaque tensors cannot be deep-copied; repack from a dense copy instead.
        return PackedLinear(self.dense_weight(), None if self.bias is None else self.bias.detach().clone())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def onednn_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [M, K] @ weight.T (+ bias) in oneDNN's GEMM, on a packed weight or a plain one."""
    return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), weight, bias, "none", [], "")


@functools.cache
def gemv_max_rows(dtype: torch.dtype, shape: tuple[int, int]) -> int:
    """The most rows a call may have to take the packed-layout GEMV here for a weight of `shape` [N, K] (0: oneDNN
    always wins), timed once per dtype and shape on probe weights packed as PackedLinear packs its own."""
    weights = probe_weights(shape, dtype)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT) for w in weights]
    layout = packed_gemv.gemv_layout(packed[0], weights[0])
    if layout is None:
        return 0
    n, ptrs = weights[0].shape[0], [torch.ops.mkldnn.data_ptr(p) for p in packed]
    del weights
    return crossover(lambda x: [packed_gemv.gemv(x, ptr, n, layout) for ptr in ptrs],
                     lambda x: [onednn_linear(pad_rows(x, shape[1])[0], p, None) for p in packed], shape[1], dtype)


def pad_rows(x: torch.Tensor, in_features: int) -> tuple[torch.Tensor, int]:
    """x as a 2-D batch of rows, zero-padded to `padded_rows`, and the real row count."""
    rows = x.reshape(-1, in_features)
    m = rows.shape[0]
    pad = padded_rows(m) - m
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, in_features)])
    return rows, m


