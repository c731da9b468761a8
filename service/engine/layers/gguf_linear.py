"""Linears and embeddings on GGUF's blocks (formats: `gguf_blocks.py`): a .gguf file's as stored, or a float
checkpoint's quantized at load into Q8_0 / Q4_1 (`--quantization int8 | int4`). No float copy of a weight is kept.

Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q6_K and Q8_0 run csrc/int4_linear.cpp, their blocks regrouped 16 output rows
together at load (`pack_q4_0` and `pack_q4_1`, a permutation; `pack_q4_k`, which also gives each 6-bit scale a byte;
`pack_q5_0` and `pack_q5_1`, the fifth bits in the kernel's order; `pack_q6_k`, its two high bits so; `pack_q8_0`, a
byte per code: several times faster than reading the rows as stored, docs/performance.md), the activations rounded
to int8 per 32 inputs as llama.cpp does; for calls of any size, except Q6_K (`prefill_op`): SmolLM2's first
layers keep their down projections in Q6_K in a Q4_K_M file, and a prefill of those with int8-rounded activations
changed its greedy answers (docs/performance.md), so past KERNEL_MAX_ROWS_DEFAULT rows its tiles are dequantized
(`q6_k_dequantize`) and multiplied in float, as for the types read as stored (an output head in Q6_K stays on the
kernel: `head_on_kernel`). Calls of few rows (decoding) of the other type (Q5_K) run an integer-weight GEMV on the
blocks (csrc/gguf_linear.cpp, int8 activations); larger calls (prefill) dequantize a tile of output rows at a time
into a scratch and multiply.
Without the native build, `dequantize` (pure torch) does the tiles for every call. A quantized decoder layer hands
its linears to csrc/llama_layer.cpp (`kernel_op`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from sluice.service.engine.layers.gguf_blocks import (
    BLOCK_TYPES,
    GROUP,
    PACK_ROWS,
    GgufBlocks,
    dequantize,
    pack_q4_0,
    pack_q4_1,
    pack_q4_k,
    pack_q5_0,
    pack_q5_1,
    pack_q6_k,
    pack_q8_0,
    q8_0_rows,
    quantize,
    unpack_q4_0,
    unpack_q4_1,
    unpack_q4_k,
    unpack_q5_0,
    unpack_q5_1,
    unpack_q6_k,
    unpack_q8_0,
)
from sluice.service.engine.layers.linear import LinearMethod, PlainLinear

# Rows a call of a type stored as is (Q5_K), or of Q6_K, may have for the GEMV (above: dequantized tiles +
# GEMM). The GEMV unpacks every weight block once per few input rows, the tiles once per call, so the tiles win
# past a crossover that lies between 32 and 64 rows for the K-quants at SmolLM2's and 1.7B's shapes on Zen 4
# (docs/performance.md); the other packed types (PACKINGS) take every prefill chunk (their kernel reads 16 output
# rows' blocks together).
KERNEL_MAX_ROWS_DEFAULT = 32
PACKED_MAX_ROWS = 4096
TILE_ELEMENTS = 1 << 18  # a prefill tile's float scratch: 1 MiB


@dataclass(frozen=True, slots=True)
class Packing:
    """How a type is regrouped for csrc/int4_linear.cpp: its buffers (the nibbles first), the kernel op reading
    them, and the functions to them from rows as stored and back (`rows`: single rows read in place, where an
    embedding looks them up: without it, each row's whole block of 16 is unpacked). `prefill_op`: the kernel op that
    turns whole packs into float32 rows, for a type whose calls past KERNEL_MAX_ROWS_DEFAULT rows multiply float
    tiles instead of int8-rounded activations (None: the packed kernel takes calls of every size)."""

    buffers: tuple[str, ...]
    kernel_op: str
    pack: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    unpack: Callable[..., torch.Tensor]
    rows: Callable[..., torch.Tensor] | None = None
    prefill_op: str | None = None


PACKINGS = {"Q4_0": Packing(("blocks", "scale"), "q4_0_linear", pack_q4_0, unpack_q4_0),
            "Q4_1": Packing(("blocks", "scale", "minimum"), "int4_linear", pack_q4_1, unpack_q4_1),
            "Q4_K": Packing(("blocks", "scales_mins", "supers"), "q4_k_linear", pack_q4_k, unpack_q4_k),
            "Q5_0": Packing(("blocks", "fifth", "scale"), "q5_0_linear", pack_q5_0, unpack_q5_0),
            "Q5_1": Packing(("blocks", "fifth", "scale_min"), "q5_1_linear", pack_q5_1, unpack_q5_1),
            "Q6_K": Packing(("blocks", "high_scales", "supers"), "q6_k_linear", pack_q6_k, unpack_q6_k,
                            prefill_op="q6_k_dequantize"),
            "Q8_0": Packing(("blocks", "scale"), "q8_0_packed_linear", pack_q8_0, unpack_q8_0, q8_0_rows)}


class GgufLinear(nn.Module):
    """y = x W^T + b with W in GGUF blocks; float activations in and out (computed in float32). `blocks`: the rows
    as stored, or for the types PACKINGS names, with a kernel, the packed codes, with the type's other buffers
    (`repack=False` keeps the rows: bench/packed_linears.py times the packing against them)."""

    def __init__(self, blocks: GgufBlocks, bias: torch.Tensor | None = None, kernel=None, repack: bool = True) -> None:
        super().__init__()
        _, qk, nbytes = BLOCK_TYPES[blocks.qtype]
        self.in_features, self.out_features = blocks.in_features, blocks.data.shape[0]
        if self.in_features % qk or blocks.data.shape[1] != self.in_features // qk * nbytes:
            raise ValueError(f"{blocks.qtype} rows of {blocks.data.shape[1]} bytes for {self.in_features} inputs")
        self.qtype, self.type_id = blocks.qtype, BLOCK_TYPES[blocks.qtype][0]
        self.packed = kernel is not None and repack and blocks.qtype in PACKINGS
        if self.packed:
            packing = PACKINGS[blocks.qtype]
            for name, t in zip(packing.buffers, packing.pack(blocks.data), strict=True):
                self.register_buffer(name, t)
        else:
            self.register_buffer("blocks", blocks.data)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.kernel = kernel  # native.load(), or None: every call dequantizes tiles in torch
        whole_calls = self.packed and PACKINGS[self.qtype].prefill_op is None
        self.kernel_max_rows = 0 if kernel is None else PACKED_MAX_ROWS if whole_calls else KERNEL_MAX_ROWS_DEFAULT
        self.kernel_dtype = torch.float32  # what kernel_op's linear computes in
        self.tile_rows = max(PACK_ROWS, TILE_ELEMENTS // self.in_features // PACK_ROWS * PACK_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] → [..., N]."""
        rows = x.reshape(-1, self.in_features).float()
        if self.kernel is not None and rows.shape[0] <= self.kernel_max_rows:
            out = self._packed_linear(rows) if self.packed else self.kernel.gguf_linear(rows, self.blocks, self.type_id)
        else:
            out = torch.empty(rows.shape[0], self.out_features)
            for n in range(0, self.out_features, self.tile_rows):
                tile = self.float_rows(n, n + self.tile_rows)
                torch.mm(rows, tile.t(), out=out[:, n:n + tile.shape[0]])
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def _packed(self) -> list[torch.Tensor]:
        """The packed buffers, in PACKINGS' order."""
        return [getattr(self, name) for name in PACKINGS[self.qtype].buffers]

    def _packed_linear(self, rows: torch.Tensor) -> torch.Tensor:
        return getattr(self.kernel, PACKINGS[self.qtype].kernel_op)(rows, *self._packed(), self.out_features)

    def stored_rows(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) of the weight as GGUF stores them (uint8 [rows, row_bytes]), unpacked where packed."""
        stop = self.out_features if stop is None else min(stop, self.out_features)
        if not self.packed:
            return self.blocks[start:stop]
        return self._from_packs(start, stop, PACKINGS[self.qtype].unpack)

    def float_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the weight as float32 [rows, K]: a prefill tile."""
        stop = min(stop, self.out_features)
        op = PACKINGS[self.qtype].prefill_op if self.packed else None
        if op is None:
            return dequantize(self.stored_rows(start, stop), self.qtype, self.in_features, self.kernel)
        return self._from_packs(start, stop, lambda *packs: getattr(self.kernel, op)(*packs[:-1]))

    def _from_packs(self, start: int, stop: int, convert: Callable[..., torch.Tensor]) -> torch.Tensor:
        """Rows [start, stop) of convert(*the packed buffers of the packs holding them, those packs' row count)."""
        first, last = start // PACK_ROWS, -(-stop // PACK_ROWS)
        rows = convert(*(t[first:last] for t in self._packed()), (last - first) * PACK_ROWS)
        return rows[start - first * PACK_ROWS:stop - first * PACK_ROWS]

    def rows_at(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` (int64 [n]) as GGUF stores them, uint8 [n, row_bytes]: an embedding's lookup."""
        if not self.packed:
            return self.blocks.index_select(0, ids)
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.out_features:  # as index_select refuses
            raise IndexError(f"row ids out of range for {self.out_features} rows")
        packing = PACKINGS[self.qtype]
        if packing.rows is not None:
            return packing.rows(*self._packed(), ids)
        packs, where = torch.unique(ids // PACK_ROWS, return_inverse=True)
        rows = packing.unpack(*(t.index_select(0, packs) for t in self._packed()), len(packs) * PACK_ROWS)
        return rows.view(len(packs), PACK_ROWS, -1)[where, ids % PACK_ROWS]

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [N, K] the blocks stand for (tests and references only)."""
        return dequantize(self.stored_rows(), self.qtype, self.in_features)

    def kernel_op(self):
        """This linear as csrc/llama_layer.cpp's LayerLinear, or None (no kernel, or a bias)."""
        if self.kernel is None or self.bias is not None or (self.qtype == "Q4_1" and not self.packed):
            return None
        if self.packed:  # a, b, c: the packed buffers, an empty c where there are two
            tensors = [*self._packed(), torch.empty(0)][:3]
            return self.kernel.LayerLinear(self.type_id, *tensors, self.out_features)
        empty = torch.empty(0)
        return self.kernel.LayerLinear(self.type_id, self.blocks, empty, empty, self.out_features)

    def extra_repr(self) -> str:
        kernel = (", packed, int4_linear.cpp" if self.packed else ", integer GEMV") if self.kernel is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.qtype}{kernel}"


def head_on_kernel(linear: nn.Module) -> nn.Module:
    """An output head on its packed kernel for calls of every size, Q6_K's too (`prefill_op` is for the layers'
    prefill): a head's rows are the sampled rows, one per sequence, so a decode step of 64 sequences computes each
    row as a step of one does, the same logits whatever the batch (llama.cpp too rounds a Q6_K head's activations,
    per 256). A Q4_0 or Q4_K_M file of a model whose hidden size is a multiple of 256 keeps its head in Q6_K, and
    float tiles of it at every step of a large batch cost more than the layers' kernels (docs/performance.md)."""
    if isinstance(linear, GgufLinear) and linear.packed:
        linear.kernel_max_rows = PACKED_MAX_ROWS
    return linear


class GgufEmbedding(nn.Module):
    """Token embeddings in GGUF blocks: only the looked-up rows are dequantized, into `dtype`. The blocks are a
    GgufLinear's (`table`, packed where its type is), which a tied head runs: one copy of the bytes."""

    def __init__(self, blocks: GgufBlocks, dtype: torch.dtype, kernel=None) -> None:
        super().__init__()
        self.qtype, self.embedding_dim, self.dtype, self.kernel = blocks.qtype, blocks.in_features, dtype, kernel
        self.table = GgufLinear(blocks, None, kernel)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] → [..., E]."""
        rows = self.table.rows_at(ids.reshape(-1))
        out = dequantize(rows, self.qtype, self.embedding_dim, self.kernel).to(self.dtype)
        return out.view(*ids.shape, self.embedding_dim)


class MergedLinear(nn.Module):
    """Linears of one input side by side whose formats differ (a GGUF may store q and v in different types)."""

    kernel_dtype = torch.float32  # a GGUF file's linears compute in float32, as GgufLinear

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)

    @property
    def kernel_max_rows(self) -> int:
        """The fewest rows any part's GEMV takes."""
        return min(getattr(part, "kernel_max_rows", 0) for part in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The parts' outputs concatenated along the last dim."""
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def kernel_op(self):
        """The parts as one csrc/llama_layer.cpp LayerLinear, or None where a part has none."""
        ops = [getattr(part, "kernel_op", lambda: None)() for part in self.parts]
        return None if None in ops else self.parts[0].kernel.LayerLinear(ops)


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
        linear = GgufLinear(GgufBlocks(data, kinds[0], weights[0].in_features), bias, self.kernel)
        return head_on_kernel(linear) if parts == ["lm_head"] else linear

    def embedding(self, weight, device, dtype):
        if isinstance(weight, GgufBlocks):
            return GgufEmbedding(weight, dtype, self.kernel)
        return super().embedding(weight, device, dtype)

    def tied_head(self, embed):
        if isinstance(embed, GgufEmbedding):
            self.made[embed.qtype] += 1
            return head_on_kernel(embed.table)
        return super().tied_head(embed)

    def describe(self) -> str:
        return f"{self.name}: {dict(self.made)} (type: linears)"


class QuantizeMethod(GgufBlockMethod):
    """`--quantization int8 | int4`: a float checkpoint's linears quantized at load into GGUF Q8_0 or Q4_1 blocks
    (int4's head in Q8_0, as llama.cpp keeps it: in 4 bits it alone took SmolLM2's perplexity from 7.10 to 7.52), the
    embedding in Q8_0 with a tied head reading its bytes; a weight whose input size is not a multiple of 32 stays
    float32."""

    def __init__(self, name: str, kernel=None) -> None:
        super().__init__(torch.float32, kernel)
        self.qtype = {"int8": "Q8_0", "int4": "Q4_1"}[name]
        self.name = f"{name} ({self.qtype} blocks)"

    def make(self, weight, bias, parts, sizes, tied=False):
        if weight.shape[1] % GROUP:
            self.made["F32"] += 1
            return PlainLinear(weight.float(), None if bias is None else bias.float(), pad=True)
        qtype = "Q8_0" if parts == ["lm_head"] else self.qtype
        self.made[qtype] += 1
        return GgufLinear(GgufBlocks(quantize(weight, qtype), qtype, weight.shape[1]), bias, self.kernel)

    def make_parts(self, weights, biases, parts, device, dtype):
        return LinearMethod.make_parts(self, weights, biases, parts, device, dtype)

    def embedding(self, weight, device, dtype):
        if weight.shape[1] % GROUP:
            return LinearMethod.embedding(self, weight, device, torch.float32)
        return GgufEmbedding(GgufBlocks(quantize(weight, "Q8_0"), "Q8_0", weight.shape[1]), torch.float32, self.kernel)
