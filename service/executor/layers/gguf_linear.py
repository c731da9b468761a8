"""Linears and embeddings on GGUF blocks (the types of quant_types.py): a .gguf file's as stored, or a float
checkpoint's quantized at load into Q8_0 / Q4_1 (`--quantization int8 | int4`). No float copy of a weight is kept.

`GgufMethod` keeps a weight in one of two layouts. A type the table gives a `Packing` is regrouped at load (where the
extension is built), 16 output rows together, for csrc/int4_linear.cpp's packed kernel, every bit kept: calls of up to
PACKED_MAX_ROWS rows (every prefill chunk) run that kernel, the activations rounded to int8 per 32 inputs as llama.cpp
rounds them; larger calls multiply float tiles dequantized from the packs. Rows kept as stored (`repack=False`, or a
type the table gives no packing) run csrc/gguf_linear.cpp's GEMV for calls of up to STORED_MAX_ROWS rows (int8
activations), float tiles for larger ones. Without the extension every call multiplies tiles dequantized in torch. The
C++ side finds each type's kernels by its id (csrc/gguf_linear.cpp's kQuantTypes), never by name.
"""

from __future__ import annotations

import copy
from collections import Counter

import torch
from torch import nn

from sluice import native
from sluice.service.executor.layers.gguf_blocks import GROUP, GgufBlocks, quantize
from sluice.service.executor.layers.gguf_packs import PACK_ROWS, pack_in_slices
from sluice.service.executor.layers.half_linear import HalfEmbedding, HalfLinear
from sluice.service.executor.layers.linear import (
    KernelFacts,
    Linear,
    LinearMethod,
    PlainLinear,
    WeightFormat,
    check_row_ids,
    set_bias,
)
from sluice.service.executor.layers.quant_types import (
    PACKED_MAX_ROWS,
    STORED_MAX_ROWS,
    dequantize,
    quant_type,
)

# GGUF's 16-bit float tensors, served as stored by half_linear.py under float32 activations: torch dtype → type name.
HALF_TYPES = {torch.float16: "F16", torch.bfloat16: "BF16"}
TILE_ELEMENTS = 1 << 18  # a prefill tile's float scratch: 1 MiB


class GgufMethod(LinearMethod):
    """A weight's GGUF blocks of one quant type (`quant`, its table row), computed in float32. `kernel`: the built
    extension, or None (torch dequantize for every call); `repack=False` keeps a packed type's rows as stored (bench/
    packed_linears.py times the two)."""

    def __init__(self, kernel=None, repack: bool = True) -> None:
        self.kernel, self.repack = kernel, repack

    def __deepcopy__(self, memo: dict) -> GgufMethod:
        return copy.copy(self)  # no tensors here (the layer holds them); the extension module is shared

    def create_weights(self, layer, blocks: GgufBlocks, bias):
        quant = quant_type(blocks.qtype)
        self.quant, self.qtype = quant, quant.name
        n, k = blocks.data.shape[0], blocks.in_features
        if blocks.data.shape[1] != quant.row_bytes(k):
            raise ValueError(f"{quant.name} rows of {blocks.data.shape[1]} bytes for {k} inputs")
        self.packed = self.kernel is not None and self.repack and quant.packing is not None
        if self.packed:
            packed = pack_in_slices(quant.packing.packer(self.kernel), blocks.data.contiguous())
            for name, t in zip(quant.packing.buffers, packed, strict=True):
                layer.register_buffer(name, t)
        else:
            layer.register_buffer("blocks", blocks.data)
        set_bias(layer, None if bias is None else bias.float())
        if self.kernel is not None:
            self.max_rows = PACKED_MAX_ROWS if self.packed else STORED_MAX_ROWS
        self.tile_rows = max(PACK_ROWS, TILE_ELEMENTS // k // PACK_ROWS * PACK_ROWS)
        return n, k

    def packs(self, layer: Linear) -> list[torch.Tensor]:
        """The packed buffers, in the table's order."""
        return [layer.get_buffer(name) for name in self.quant.packing.buffers]

    def _kernel_tensors(self, layer: Linear) -> list[torch.Tensor]:
        """The three tensors the C++ kernels take: the packs (an empty third where there are two) or the blocks."""
        empty = torch.empty(0)
        return [*self.packs(layer), empty][:3] if self.packed else [layer.blocks, empty, empty]

    def apply(self, layer, rows):
        x = rows.float()
        if self.kernel is not None and x.shape[0] <= self.max_rows:
            if self.packed:
                out = self.kernel.quant_linear(x, self.quant.type_id, *self._kernel_tensors(layer), layer.out_features)
            else:
                out = self.kernel.gguf_linear(x, layer.blocks, self.quant.type_id)
        else:
            out = torch.empty(x.shape[0], layer.out_features)
            for n in range(0, layer.out_features, self.tile_rows):
                tile = self.float_rows(layer, n, n + self.tile_rows)
                torch.mm(x, tile.t(), out=out[:, n:n + tile.shape[0]])
        if layer.bias is not None:
            out += layer.bias
        return out.to(rows.dtype)

    def stored_rows(self, layer: Linear, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) of the weight as GGUF stores them (uint8 [rows, row_bytes]), unpacked where packed."""
        stop = layer.out_features if stop is None else min(stop, layer.out_features)
        if not self.packed:
            return layer.blocks[start:stop]
        first, last = start // PACK_ROWS, -(-stop // PACK_ROWS)  # the packs of 16 rows holding them
        rows = self.quant.packing.unpack(*(t[first:last] for t in self.packs(layer)), (last - first) * PACK_ROWS)
        return rows[start - first * PACK_ROWS:stop - first * PACK_ROWS]

    def float_rows(self, layer: Linear, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the weight as float32 [rows, K]: a prefill tile."""
        return dequantize(self.stored_rows(layer, start, stop), self.qtype, layer.in_features, self.kernel)

    def rows_at(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` (int64 [n]) as GGUF stores them, uint8 [n, row_bytes]: an embedding's lookup."""
        if not self.packed:
            return layer.blocks.index_select(0, ids)
        check_row_ids(ids, layer.out_features)
        packing = self.quant.packing
        if packing.rows is not None:
            return packing.rows(*self.packs(layer), ids)
        packs, where = torch.unique(ids // PACK_ROWS, return_inverse=True)
        rows = packing.unpack(*(t.index_select(0, packs) for t in self.packs(layer)), len(packs) * PACK_ROWS)
        return rows.view(len(packs), PACK_ROWS, -1)[where, ids % PACK_ROWS]

    def dense_weight(self, layer):
        return dequantize(self.stored_rows(layer), self.qtype, layer.in_features)

    def layer_op(self, layer):
        if self.kernel is None:
            return None
        return self.kernel.LayerLinear(self.quant.type_id, *self._kernel_tensors(layer), layer.out_features,
                                       layer.bias)

    def describe(self, layer):
        kernel = (", packed kernel" if self.packed else ", GEMV on the blocks") if self.kernel is not None else ""
        return f"{self.qtype}{kernel}"


class GgufLinear(Linear):
    """A Linear on GGUF blocks (GgufMethod)."""

    def __init__(self, blocks: GgufBlocks, bias: torch.Tensor | None = None, kernel=None,
                 repack: bool = True) -> None:
        super().__init__(GgufMethod(kernel, repack), blocks, bias)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [N, K] the blocks stand for (service/bench's name for dense_weight)."""
        return self.dense_weight()


class GgufEmbedding(nn.Module):
    """Token embeddings in GGUF blocks: only the looked-up rows are dequantized, into `dtype`. The blocks are a
    GgufLinear's (`table`, packed where its type is), which a tied head runs: one copy of the bytes."""

    def __init__(self, blocks: GgufBlocks, dtype: torch.dtype, kernel=None) -> None:
        super().__init__()
        self.qtype, self.embedding_dim, self.dtype, self.kernel = blocks.qtype, blocks.in_features, dtype, kernel
        self.table = GgufLinear(blocks, None, kernel)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] → [..., E]."""
        rows = self.table.method.rows_at(self.table, ids.reshape(-1))
        out = dequantize(rows, self.qtype, self.embedding_dim, self.kernel).to(self.dtype)
        return out.view(*ids.shape, self.embedding_dim)


class MergedMethod(LinearMethod):
    """Linears of one input side by side (`layer.parts`, each in its own format: a GGUF file may store q and v in
    different types); the parts carry their own biases. Its kernel: the parts' ops as one LayerLinear."""

    def create_weights(self, layer, parts: list[Linear], bias):
        if bias is not None:
            raise ValueError("a merged linear's parts carry their own biases")
        layer.parts = nn.ModuleList(parts)
        set_bias(layer, None)
        return sum(p.out_features for p in parts), parts[0].in_features

    def apply(self, layer, rows):
        return torch.cat([part(rows) for part in layer.parts], dim=-1)

    def dense_weight(self, layer):
        return torch.cat([part.dense_weight() for part in layer.parts])

    def kernel_facts(self, layer):
        facts = [part.kernel_facts() for part in layer.parts]
        ops = [f.op for f in facts]
        op = None if any(o is None for o in ops) else native.load().LayerLinear(ops)
        return KernelFacts(op, min(f.max_rows for f in facts), facts[0].dtype)


class MergedLinear(Linear):
    """A Linear of parts side by side (MergedMethod)."""

    def __init__(self, parts: list[Linear]) -> None:
        super().__init__(MergedMethod(), parts)


class GgufFormat(WeightFormat):
    """Each linear in its GGUF file's block type as stored; q/k/v and gate/up fused where their types match (else
    side by side); F32 tensors plain, F16 and BF16 ones 16-bit weights (half_linear.py); the embedding in blocks
    or 16 bits, a tied head reading the same bytes."""

    def __init__(self, dtype: torch.dtype, kernel=None) -> None:
        self.dtype, self.kernel, self.made = dtype, kernel, Counter()
        self.name = "GGUF blocks as stored" + (" (integer GEMV)" if kernel is not None else " (torch dequantize)")

    def make(self, weight, bias, parts, sizes, tied=False):
        return self.make_parts([weight], [bias], parts, weight.device, self.dtype)

    def make_parts(self, weights, biases, parts, device, dtype):
        kinds = [w.qtype if isinstance(w, GgufBlocks) else str(w.dtype) for w in weights]
        if len(set(kinds)) > 1:
            return MergedLinear([self.make_parts([w], [b], [p], device, dtype)
                                 for w, b, p in zip(weights, biases, parts, strict=True)])
        bias = None if biases[0] is None else torch.cat(biases).float()
        if not isinstance(weights[0], GgufBlocks):
            weight = weights[0] if len(weights) == 1 else torch.cat(weights)  # one tensor: a tied head shares it
            if weight.dtype in HALF_TYPES and dtype == torch.float32:
                self.made[HALF_TYPES[weight.dtype]] += 1
                return HalfLinear(weight, bias, weight.dtype, self.kernel)
            self.made["F32"] += 1
            return PlainLinear(weight.to(dtype), None if bias is None else bias.to(dtype), pad=True)
        self.made[kinds[0]] += 1
        data = torch.cat([w.data for w in weights]) if len(weights) > 1 else weights[0].data
        return GgufLinear(GgufBlocks(data, kinds[0], weights[0].in_features), bias, self.kernel)

    def embedding(self, weight, device, dtype):
        if isinstance(weight, GgufBlocks):
            return GgufEmbedding(weight, dtype, self.kernel)
        if weight.dtype in HALF_TYPES and dtype == torch.float32:
            return HalfEmbedding(weight, weight.dtype, self.kernel)
        return super().embedding(weight, device, dtype)

    def tied_head(self, embed):
        return _blocks_head(self, embed)

    def describe(self) -> str:
        return f"{self.name}: {dict(self.made)} (type: linears)"


def _blocks_head(formats: GgufFormat | QuantizeFormat, embed: nn.Module) -> nn.Module:
    """A head tied to `embed`: its table, where the embedding is in GGUF blocks (one copy of the bytes)."""
    if isinstance(embed, GgufEmbedding | HalfEmbedding):
        formats.made[HALF_TYPES[embed.table.packed.dtype] if isinstance(embed, HalfEmbedding) else embed.qtype] += 1
        return embed.table
    return WeightFormat.tied_head(formats, embed)


class QuantizeFormat(WeightFormat):
    """`--quantization int8 | int4`: a float checkpoint's linears quantized at load into GGUF Q8_0 or Q4_1 blocks
    (int4's head in Q8_0, as llama.cpp keeps it: a 4-bit head costs the most quality per byte saved), the embedding
    in Q8_0 with a tied head reading its bytes; a weight whose input size is not a multiple of 32 stays float32."""

    def __init__(self, name: str, kernel=None) -> None:
        self.kernel, self.made = kernel, Counter()
        self.qtype = {"int8": "Q8_0", "int4": "Q4_1"}[name]
        self.name = f"{name} ({self.qtype} blocks)"

    def make(self, weight, bias, parts, sizes, tied=False):
        if weight.shape[1] % GROUP:
            self.made["F32"] += 1
            return PlainLinear(weight.float(), None if bias is None else bias.float(), pad=True)
        qtype = "Q8_0" if parts == ["lm_head"] else self.qtype
        self.made[qtype] += 1
        return GgufLinear(GgufBlocks(quantize(weight, qtype), qtype, weight.shape[1]), bias, self.kernel)

    def embedding(self, weight, device, dtype):
        if weight.shape[1] % GROUP:
            return super().embedding(weight, device, torch.float32)
        return GgufEmbedding(GgufBlocks(quantize(weight, "Q8_0"), "Q8_0", weight.shape[1]), torch.float32, self.kernel)

    def tied_head(self, embed):
        return _blocks_head(self, embed)

    def describe(self) -> str:
        return f"{self.name}: {dict(self.made)} (type: linears)"


