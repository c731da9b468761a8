"""The one table of the GGUF quant types Sluice serves, as llama.cpp keeps its `type_traits[]`: a row per type with
its GGML id, block size and bytes, its torch dequantizer and its regrouping for csrc/int4_linear.cpp's packed kernel
(if it has one).

csrc/gguf_linear.cpp's `kQuantTypes` mirrors this table row for row, by the same ids (each row there names the type's
kernels: the GEMV and dequantizer on blocks as stored, the packed kernel); the extension's `quant_types()` lists it
and tests/executor/layers/test_quant_types.py checks that the two agree. Adding a type is its row here, its block
unpacker and row there, and its test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sluice.service.executor.layers.gguf_blocks import (
    bits32,
    half_at,
    iq4_xs_scales,
    k4_scales,
    k5_fifth_bits,
    q2_k_fields,
    q3_k_fields,
    split_nibbles,
)
from sluice.service.executor.layers.gguf_packs import (
    pack_iq4_xs,
    pack_q2_k,
    pack_q3_k,
    pack_q4_0,
    pack_q4_1,
    pack_q4_k,
    pack_q5_0,
    pack_q5_1,
    pack_q5_k,
    pack_q6_k,
    pack_q8_0,
    q8_0_rows,
    unpack_iq4_xs,
    unpack_q2_k,
    unpack_q3_k,
    unpack_q4_0,
    unpack_q4_1,
    unpack_q4_k,
    unpack_q5_0,
    unpack_q5_1,
    unpack_q5_k,
    unpack_q6_k,
    unpack_q8_0,
)

# The row limits of the kernels. The GEMV on blocks as stored unpacks every block once per few input rows,
# dequantized tiles once per call, so past a few dozen rows the tiles + GEMM win; a packed kernel reads 16 output
# rows' blocks together and takes whole prefill chunks (activations rounded to int8 per 32, as llama.cpp's).
STORED_MAX_ROWS = 32
PACKED_MAX_ROWS = 4096


@dataclass(frozen=True, slots=True)
class Packing:
    """A type's regrouping for csrc/int4_linear.cpp: its buffers (the codes first), the functions to them from rows
    as stored and back, and `rows`: single rows read in place, where an embedding looks them up (None: each row's
    whole pack of 16 is unpacked)."""

    buffers: tuple[str, ...]
    pack: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    unpack: Callable[..., torch.Tensor]
    rows: Callable[..., torch.Tensor] | None = None
    native_pack: str | None = None  # the built kernels' op doing `pack` in one pass (the same bytes), if any

    def packer(self, kernel) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
        """`pack`, or its native op where `kernel` (the built extension, or None) has one."""
        return getattr(kernel, self.native_pack) if kernel is not None and self.native_pack else self.pack


@dataclass(frozen=True, slots=True)
class QuantType:
    """One GGUF quant type: `dequantize` turns blocks uint8 [nb, block_bytes] into float32 [nb, block_size];
    `packing` None: the kernels read its blocks as stored, calls of up to STORED_MAX_ROWS rows on the GEMV."""

    name: str
    type_id: int  # gguf.GGMLQuantizationType's value
    block_size: int
    block_bytes: int
    dequantize: Callable[[torch.Tensor], torch.Tensor]
    packing: Packing | None = None

    def row_bytes(self, in_features: int) -> int:
        """Bytes of one row of `in_features` inputs; ValueError where they are not whole blocks."""
        if in_features % self.block_size:
            raise ValueError(f"{self.name} blocks hold {self.block_size} inputs, not a divisor of {in_features}")
        return in_features // self.block_size * self.block_bytes


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return half_at(b, 0) * (split_nibbles(b[:, 2:]).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return half_at(b, 0) * split_nibbles(b[:, 4:]).float() + half_at(b, 2)


def _q5_codes(b: torch.Tensor, head: int) -> torch.Tensor:
    """Q5_0 (head 2) or Q5_1 (head 4) blocks → the 5-bit codes: the nibbles, and bit j of qh as element j's fifth."""
    return (split_nibbles(b[:, head + 4:]) | (bits32(b[:, head:head + 4]) << 4)).float()


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return half_at(b, 0) * (_q5_codes(b, 2) - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return half_at(b, 0) * _q5_codes(b, 4) + half_at(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return half_at(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()


def _k4(b: torch.Tensor, five: bool) -> torch.Tensor:
    """Q4_K or Q5_K (`five`) blocks: eight sub-blocks of 32, each d * scale * q - dmin * minimum."""
    scale, minimum = (t.float() for t in k4_scales(b[:, 4:16]))
    qs = b[:, 48:] if five else b[:, 16:]
    q = split_nibbles(qs.reshape(-1, 4, 32)).reshape(-1, 8, 32)  # sub-block 2j: chunk j's low nibbles, 2j+1 high
    if five:
        q = q | (k5_fifth_bits(b) << 4)
    d = half_at(b, 0)[:, :, None] * scale[:, :, None]
    return (d * q.float() - half_at(b, 2)[:, :, None] * minimum[:, :, None]).reshape(-1, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = split_nibbles(b[:, :128].reshape(-1, 2, 64))  # [nb, 2, 128]
    qh = (b[:, 128:192].reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3
    q = (ql | (qh.reshape(-1, 2, 128) << 4)).float() - 32
    scale = b[:, 192:208].contiguous().view(torch.int8).float() * half_at(b, 208)
    return (scale.repeat_interleave(16, dim=-1) * q.reshape(-1, 256)).reshape(-1, 256)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    """Q2_K blocks: sixteen groups of 16, each d * scale * q - dmin * minimum, q a 2-bit code."""
    codes, scale, minimum = q2_k_fields(b)
    dl, ml = half_at(b, 80) * scale.float(), half_at(b, 82) * minimum.float()
    return dl.repeat_interleave(16, dim=-1) * codes.reshape(-1, 256).float() - ml.repeat_interleave(16, dim=-1)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    """Q3_K blocks: sixteen groups of 16, each d * (its 6-bit scale - 32) * q, q a 3-bit code less 4."""
    codes, scales = q3_k_fields(b)
    scale = half_at(b, 108) * (scales.float() - 32)
    return scale.repeat_interleave(16, dim=-1) * (codes.reshape(-1, 256).float() - 4)


# IQ4_NL's 16 levels (llama.cpp's kvalues_iq4nl): a nibble picks one, times the block's d.
IQ4_NL_VALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                             dtype=torch.float32)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return half_at(b, 0) * IQ4_NL_VALUES[split_nibbles(b[:, 2:]).long()]


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """IQ4_XS blocks: IQ4_NL's levels in eight groups of 32, each d * (its 6-bit scale - 32) * level."""
    scale = half_at(b, 0) * (iq4_xs_scales(b).float() - 32)
    return (scale[:, :, None] * IQ4_NL_VALUES[split_nibbles(b[:, 8:].reshape(-1, 8, 16)).long()]).reshape(-1, 256)


QUANT_TYPES: dict[int, QuantType] = {t.type_id: t for t in (
    QuantType("Q4_0", 2, 32, 18, _q4_0, Packing(("blocks", "scale"), pack_q4_0, unpack_q4_0)),
    QuantType("Q4_1", 3, 32, 20, _q4_1, Packing(("blocks", "scale", "minimum"), pack_q4_1, unpack_q4_1)),
    QuantType("Q5_0", 6, 32, 22, _q5_0, Packing(("blocks", "fifth", "scale"), pack_q5_0, unpack_q5_0)),
    QuantType("Q5_1", 7, 32, 24, _q5_1, Packing(("blocks", "fifth", "scale_min"), pack_q5_1, unpack_q5_1)),
    QuantType("Q8_0", 8, 32, 34, _q8_0, Packing(("blocks", "scale"), pack_q8_0, unpack_q8_0, q8_0_rows)),
    QuantType("Q2_K", 10, 256, 84, _q2_k,
              Packing(("blocks", "scales_mins", "supers"), pack_q2_k, unpack_q2_k, native_pack="pack_q2_k")),
    QuantType("Q3_K", 11, 256, 110, _q3_k,
              Packing(("blocks", "scales", "supers"), pack_q3_k, unpack_q3_k, native_pack="pack_q3_k")),
    QuantType("Q4_K", 12, 256, 144, lambda b: _k4(b, five=False),
              Packing(("blocks", "scales_mins", "supers"), pack_q4_k, unpack_q4_k, native_pack="pack_q4_k")),
    QuantType("Q5_K", 13, 256, 176, lambda b: _k4(b, five=True),
              Packing(("blocks", "high_scales_mins", "supers"), pack_q5_k, unpack_q5_k, native_pack="pack_q5_k")),
    QuantType("Q6_K", 14, 256, 210, _q6_k,
              Packing(("blocks", "high_scales", "supers"), pack_q6_k, unpack_q6_k, native_pack="pack_q6_k")),
    # IQ4_NL: Q4_0's block layout, levels for codes
    QuantType("IQ4_NL", 20, 32, 18, _iq4_nl, Packing(("blocks", "scale"), pack_q4_0, unpack_q4_0)),
    QuantType("IQ4_XS", 23, 256, 136, _iq4_xs, Packing(("blocks", "scales", "supers"), pack_iq4_xs, unpack_iq4_xs)),
)}
BY_NAME: dict[str, QuantType] = {t.name: t for t in QUANT_TYPES.values()}


def quant_type(name: str) -> QuantType:
    """The table's row for a GGML type name; ValueError naming the types served where it has none."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"no GGUF quant type {name!r}: one of {', '.join(BY_NAME)}") from None


def dequantize(data: torch.Tensor, qtype: str, in_features: int, kernel=None) -> torch.Tensor:
    """Rows of blocks uint8 [N, row_bytes] → float32 [N, in_features]; in C++ where `kernel` is the built ops."""
    t = quant_type(qtype)
    if kernel is not None:
        return kernel.gguf_dequantize(data, t.type_id, in_features)
    return t.dequantize(data.reshape(-1, t.block_bytes)).reshape(data.shape[0], in_features)
