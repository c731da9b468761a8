"""Q2_K, Q3_K, Q4_0, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, IQ4_NL and IQ4_XS regrouped for csrc/int4_linear.cpp
(q2_k_linear, q3_k_linear, q4_0_linear, q5_0_linear, q5_1_linear, q5_k_linear, q6_k_linear, q8_0_packed_linear,
iq4_nl_linear, iq4_xs_linear): every bit of the file kept,
the kernel against the exact product of the int8-rounded activations and the file's weights, every instruction set
the same, and the fused layer's linear on the same kernel (test_gguf_blocks runs a tiny Llama with Q4_0, Q5_0, Q5_1,
Q5_K, Q8_0 and IQ4_XS linears through the fused layer and the Python path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.service.executor.layers.gguf_blocks import GgufBlocks, quantize
from sluice.service.executor.layers.gguf_linear import GgufEmbedding, GgufFormat, GgufLinear
from sluice.service.executor.layers.gguf_packs import (
    pack_iq4_xs,
    pack_q2_k,
    pack_q3_k,
    pack_q4_0,
    pack_q5_0,
    pack_q5_1,
    pack_q5_k,
    pack_q6_k,
    pack_q8_0,
    unpack_iq4_xs,
    unpack_q2_k,
    unpack_q3_k,
    unpack_q4_0,
    unpack_q5_0,
    unpack_q5_1,
    unpack_q5_k,
    unpack_q6_k,
    unpack_q8_0,
)
from sluice.service.executor.layers.quant_types import BY_NAME, PACKED_MAX_ROWS, dequantize
from tests.support.gguf_files import random_blocks
from tests.support.int8_rounding import int8_rounded, k_quant_reference
from tests.support.kernels import integer_kernels, variant_isas

PACKS = {"Q2_K": (pack_q2_k, unpack_q2_k, "q2_k_linear"), "Q3_K": (pack_q3_k, unpack_q3_k, "q3_k_linear"),
         "Q4_0": (pack_q4_0, unpack_q4_0, "q4_0_linear"),
         "Q5_0": (pack_q5_0, unpack_q5_0, "q5_0_linear"), "Q5_1": (pack_q5_1, unpack_q5_1, "q5_1_linear"),
         "Q5_K": (pack_q5_k, unpack_q5_k, "q5_k_linear"), "Q6_K": (pack_q6_k, unpack_q6_k, "q6_k_linear"),
         "Q8_0": (pack_q8_0, unpack_q8_0, "q8_0_packed_linear"),
         "IQ4_NL": (pack_q4_0, unpack_q4_0, "iq4_nl_linear"), "IQ4_XS": (pack_iq4_xs, unpack_iq4_xs, "iq4_xs_linear")}
SHAPES = {"Q2_K": [(3, 16, 2, 16, 4), (3, 16, 2, 2, 16), (3, 2, 2, 16)],  # 2-bit codes, scales and minimums, d, -dmin
          "Q3_K": [(3, 16, 4, 16, 4), (3, 16, 2, 16), (3, 2, 16)],  # nibbles, scales less 32 per 16, d per 256
          "Q4_0": [(3, 16, 4, 16, 4), (3, 16, 16)],  # codes (nibbles), scales
          "Q5_0": [(3, 16, 4, 16, 4), (3, 16, 16, 4), (3, 16, 16)],  # codes (nibbles), fifth bits, scales
          "Q5_1": [(3, 16, 4, 16, 4), (3, 16, 16, 4), (3, 16, 2, 16)],
          "Q5_K": [(3, 16, 4, 16, 4), (3, 16, 96), (3, 2, 2, 16)],  # nibbles, fifth bits and scales, d and -dmin
          "Q6_K": [(3, 16, 4, 16, 4), (3, 16, 160), (3, 2, 16)],  # nibbles, high bits and scales, d per 256
          "Q8_0": [(3, 16, 8, 16, 4), (3, 16, 16)],  # codes (bytes), scales
          "IQ4_NL": [(3, 16, 4, 16, 4), (3, 16, 16)],  # as Q4_0's
          "IQ4_XS": [(3, 16, 4, 16, 4), (3, 16, 16), (3, 2, 16)]}  # nibbles (levels), scales less 32, d per 256
# The packs' bytes per block of the file where they take more: the 6-bit scales (and minimums) a byte each, Q3_K's
# 3-bit codes a nibble each, Q2_K's 4-bit scales and minimums a byte each.
PACKED_BYTES = {"Q5_K": 180, "IQ4_XS": 138, "Q3_K": 146, "Q2_K": 100}
# The error naming a three-buffer type's middle buffer.
MIDDLE = {"Q2_K": "scales_mins uint8", "Q3_K": "scales int8", "Q5_0": "fifth uint8", "Q5_1": "fifth uint8",
          "Q5_K": "high_scales_mins uint8", "Q6_K": "high_scales uint8", "IQ4_XS": "scales int8"}


def rows_of(linear, *bounds) -> torch.Tensor:
    """A GGUF linear's rows (bounds: start, stop) as the file stores them."""
    return linear.method.stored_rows(linear, *bounds)


def packs(linear) -> list[torch.Tensor]:
    """A packed GGUF linear's buffers, in the order its kernel takes them."""
    return linear.method.packs(linear)


def quantized(qtype: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Rows of `qtype` blocks as a tensor: gguf's own quantizer's of random floats; Q6_K, which it cannot make,
    random codes and scales with a small d (elements around 0.1) (tests/support/gguf_files.py)."""
    return torch.from_numpy(random_blocks(qtype, n, k, seed))


@pytest.mark.parametrize("qtype", list(PACKS))
def test_packing_keeps_every_bit_in_the_files_size(qtype):
    pack, unpack, _ = PACKS[qtype]
    nbytes = BY_NAME[qtype].block_bytes
    blocks = quantized(qtype, 40, 512, seed=1)  # 40 rows: the last block of 16 is padded
    packed = pack(blocks)
    assert [tuple(t.shape) for t in packed] == SHAPES[qtype] and packed[-1].dtype == torch.float16
    assert torch.equal(unpack(*packed, 40), blocks)
    raw = torch.from_numpy(np.random.default_rng(2).integers(0, 256, (48, 16 * nbytes), dtype=np.uint8))
    packed = pack(raw)  # any bytes, NaN scales too: every bit kept
    assert torch.equal(unpack(*packed, 48), raw)
    assert sum(t.numel() * t.element_size() for t in packed) == raw.numel() // nbytes * PACKED_BYTES.get(qtype, nbytes)


@pytest.mark.parametrize("qtype", [t.name for t in BY_NAME.values() if t.packing is not None])
def test_packing_a_slice_of_rows_at_a_time_gives_the_same_packs(qtype, monkeypatch):
    """Packed in slices of 16 and 32 rows (the load's bound on a pack's temporaries), the last one short and
    padded: the same buffers as packing all 72 rows at once."""
    from sluice.service.executor.layers import gguf_packs

    pack = BY_NAME[qtype].packing.pack
    blocks = quantized(qtype, 72, 512, seed=0)
    whole = pack(blocks)
    for slice_rows in (16, 32):
        monkeypatch.setattr(gguf_packs, "PACK_SLICE_BYTES", slice_rows * blocks.shape[1])
        sliced = gguf_packs.pack_in_slices(pack, blocks)
        assert len(sliced) == len(whole)
        for a, b in zip(sliced, whole, strict=True):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (qtype, slice_rows)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_the_native_k_quant_packs_are_the_torch_ones_in_every_instruction_set(qtype, kernel):
    """csrc/k_quant_pack.cpp, the load's pack of Q2_K to Q6_K rows, gives the torch packs' bytes: on
    valid blocks of 40 rows (the last pack padded) and on any bytes (a permutation of every bit, NaN scales too)."""
    t = BY_NAME[qtype]
    raw = torch.from_numpy(np.random.default_rng(3).integers(0, 256, (33, 2 * t.block_bytes), dtype=np.uint8))
    for blocks in (quantized(qtype, 40, 512, seed=4), raw):
        want = t.packing.pack(blocks)
        for isa in ("native", *variant_isas()):
            ops = kernel if isa == "native" else integer_kernels(isa)
            got = getattr(ops, t.packing.native_pack)(blocks)
            assert [x.dtype for x in got] == [x.dtype for x in want], isa
            for a, b in zip(got, want, strict=True):
                assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), isa


def test_q8_0_codes_sit_where_the_kernel_reads_them():
    """Chunk c, lane o of a group: bytes q + 128 of inputs 4c..4c+3 of row o."""
    blocks = quantize(torch.arange(32.0).repeat(16, 1) - 16, "Q8_0")  # row o: -16..15, d = 16 / 127
    codes, scale = pack_q8_0(blocks)
    q = blocks[:, 2:].view(torch.int8)
    assert torch.equal(codes[0, 0, 2, 5].view(torch.int8), q[5, 8:12] ^ -128)
    assert torch.equal(scale[0, 0], blocks[:, :2].contiguous().view(torch.float16)[:, 0])


def test_fifth_bits_sit_where_the_kernel_reads_them():
    """Output o's byte t of a group holds in bit c the fifth bit of input 4c + t, in bit 4 + c that of 16 + 4c + t."""
    blocks = torch.zeros(16, 22, dtype=torch.uint8)
    blocks[3, 2:6] = torch.tensor([1 << 6, 0, 1 << 6, 0], dtype=torch.uint8)  # row 3: inputs 6 and 22
    fifth = pack_q5_0(blocks)[1]
    want = torch.zeros(16, 4, dtype=torch.uint8)
    want[3, 2] = (1 << 1) | (1 << 5)  # 6 = 4 * 1 + 2 (low, chunk 1), 22 = 16 + 4 * 1 + 2 (high, chunk 1)
    assert torch.equal(fifth[0, 0], want)


def test_a_q6_k_head_gives_a_row_the_logits_it_gets_alone(kernel):
    # A head's rows are one per sequence: a step of 40 sequences gives each the logits it gets alone, tied or not;
    # a layer's Q6_K takes its prefill chunks on the kernel as well.
    n, k = 40, 512
    blocks = GgufBlocks(quantized("Q6_K", n, k, seed=4), "Q6_K", k)
    method = GgufFormat(torch.float32, kernel)
    cpu = torch.device("cpu")
    tied = method.tied_head(method.embedding(blocks, cpu, torch.float32))
    untied, layer = (method.make_parts([blocks], [None], [name], cpu, torch.float32)
                     for name in ("lm_head", "down_proj"))
    assert tied.method.max_rows == untied.method.max_rows == layer.method.max_rows == PACKED_MAX_ROWS
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(4))
    logits = tied(x)
    for row in (0, 17, 39):
        assert torch.equal(logits[row], tied(x[row:row + 1])[0])
    weight = dequantize(blocks.data, "Q6_K", k).double()
    want, scale = int8_rounded(x).double() @ weight.T, (x.double().abs() @ weight.abs().T).amax()
    assert ((logits.double() - want).abs() > 1e-6 * scale).sum() <= max(1, logits.numel() // 40)


@pytest.mark.parametrize("qtype", PACKS)
@pytest.mark.parametrize("rows", [1, 3, 5, 33, 70])
def test_kernel_computes_the_int8_activation_linear(qtype, rows, kernel):
    n, k = 40, 768
    blocks = quantized(qtype, n, k, seed=rows)
    linear = GgufLinear(GgufBlocks(blocks, qtype, k), None, kernel)
    assert linear.method.packed and linear.method.max_rows == PACKED_MAX_ROWS  # prefill chunks too
    assert torch.equal(rows_of(linear), blocks) and torch.equal(rows_of(linear, 5, 21), blocks[5:21])
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0  # an all-zero group: scale 0
    weight = dequantize(blocks, qtype, k).double()
    # Q4_0's (q - 8), Q5_0's (q - 16) and Q5_1's minimum all multiply the rounded activations: the exact product is
    # the reference, only the float sums' order differs (and, rarely, an activation within an ulp of a rounding tie).
    # Q5_K's minimum multiplies the float sums of the inputs, as llama.cpp's Q8_K activations carry them.
    got = linear(x).double()
    want = k_quant_reference(x, blocks, qtype, k) if qtype == "Q5_K" else int8_rounded(x).double() @ weight.T
    scale = (x.double().abs() @ weight.abs().T).amax()
    assert ((got - want).abs() > 1e-6 * scale).sum() <= max(1, got.numel() // 40)
    assert (got - x.double() @ weight.T).abs().max() <= 0.01 * scale  # the int8 rounding, no more
    op = linear.kernel_facts().op  # the fused layer's linear: the same kernel
    assert op is not None and torch.equal(getattr(kernel, PACKS[qtype][2])(x, *packs(linear), n), linear(x))


def test_halfway_activations_round_to_even_in_every_instruction_set(kernel):
    # Scale 1 (each group's largest is 127), so x.5 lands exactly halfway: half to even, as torch.round and
    # llama.cpp's nearbyint; away from zero would move a code by one, a thousandth of the output.
    k = 64
    blocks = quantized("Q8_0", 16, k, seed=9)
    x = torch.zeros(9, k)  # 9 rows: a pass of 8 and one of 1 on AVX-512
    for g in (0, 32):
        x[:, g] = 127.0
        x[:, g + 1:g + 32] = torch.arange(31) - 15.5 + torch.arange(9)[:, None] % 2
    want = int8_rounded(x).double() @ dequantize(blocks, "Q8_0", k).double().T
    halfway = torch.tensor([[-16.0, -14, -14], [-14, -14, -12]])  # -15.5, -14.5, -13.5 and one more
    assert torch.equal(int8_rounded(x)[:, 1:4], halfway.repeat(5, 1)[:9])
    for isa in ("native", *variant_isas()):
        ops = kernel if isa == "native" else integer_kernels(isa)
        got = ops.q8_0_packed_linear(x, *pack_q8_0(blocks), 16).double()
        assert (got - want).abs().max() <= 1e-6 * want.abs().max(), isa


@pytest.mark.parametrize("qtype", list(PACKS))
def test_every_instruction_set_computes_the_same(qtype, kernel):
    pack, _, op = PACKS[qtype]
    packed = pack(quantized(qtype, 48, 512, seed=6))
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(6))
    want = getattr(kernel, op)(x, *packed, 48)
    for isa in variant_isas():  # the same integer sums and the same float steps in the same order: the same bits
        assert torch.equal(getattr(integer_kernels(isa), op)(x, *packed, 48), want), isa
    with pytest.raises(RuntimeError, match="float16"):
        getattr(kernel, op)(x, *packed[:-1], packed[-1].float(), 48)
    with pytest.raises(RuntimeError, match="qs uint8"):  # the other layout's codes
        getattr(kernel, op)(x, pack_q5_0(quantized("Q5_0", 48, 512, 6))[0] if qtype == "Q8_0" else
                            pack_q8_0(quantized("Q8_0", 48, 512, 6))[0], *packed[1:], 48)
    if len(packed) == 3:  # a middle buffer of the wrong shape
        with pytest.raises(RuntimeError, match=MIDDLE[qtype]):
            getattr(kernel, op)(x, packed[0], packed[1].flatten(2)[:, :, :8].contiguous(), packed[2], 48)


@pytest.mark.parametrize("qtype", list(PACKS))
def test_embedding_rows_come_from_the_packed_table(qtype, kernel):
    blocks = quantized(qtype, 40, 256, seed=3)
    embed = GgufEmbedding(GgufBlocks(blocks, qtype, 256), torch.float32, kernel)
    assert embed.table.method.packed  # the one copy of the bytes, which a tied head runs
    ids = torch.tensor([[39, 0, 17], [16, 39, 5]])
    want = dequantize(blocks[ids.reshape(-1)], qtype, 256, kernel).view(2, 3, 256)
    assert torch.equal(embed(ids), want)
    with pytest.raises(IndexError):
        embed(torch.tensor([40]))  # a padding row of the last block of 16 is no token


def extreme_blocks(qtype: str, n: int, k: int) -> torch.Tensor:
    """Rows of one block repeated: every code at its largest (Q5_0, Q5_1: 31; Q5_K: 31 at scale 63; Q3_K: 3 at
    scale 31; Q2_K: 3 at scale 15) with d = 1 and no minimum; IQ4_NL, IQ4_XS (at scale 31): each group's first 16
    inputs level -127 and its last 16 level 113."""
    block = torch.full((BY_NAME[qtype].block_bytes,), 0xFF, dtype=torch.uint8)  # fifth bits and nibbles all set
    halves = {"Q5_1": [1.0, 0.0], "Q5_K": [1.0, 0.0], "Q2_K": [1.0, 0.0]}.get(qtype, [1.0])  # d = 1 (m = dmin = 0)
    at = {"Q3_K": 108, "Q2_K": 80}.get(qtype, 0)  # where d lies
    block[at:at + 2 * len(halves)] = torch.tensor(halves, dtype=torch.float16).view(torch.uint8)
    if qtype in ("IQ4_NL", "IQ4_XS"):
        block[{"IQ4_NL": 2, "IQ4_XS": 8}[qtype]:] = 0xF0
    return block.repeat(n, k // BY_NAME[qtype].block_size)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q5_0", "Q5_1", "Q5_K", "IQ4_NL", "IQ4_XS"])
def test_the_largest_codes_against_the_largest_activations_sum_exactly(qtype, kernel):
    # Against every activation code +-127: the largest sums a group's products reach, exact in every instruction
    # set. 16-bit lanes, which AVX2's 4-bit sums use, would wrap on 16 five-bit products; pmaddubsw's pair sums of
    # the IQ4 types' kernel bytes (level + 128: 241) against 127 would saturate, so AVX2 sums the levels' signed bytes.
    n, k = 16, 512
    blocks = extreme_blocks(qtype, n, k)
    x = torch.full((3, k), 1.0)
    x[1] = -1.0
    x[2, ::2] = -1.0
    linear = GgufLinear(GgufBlocks(blocks, qtype, k), None, kernel)
    want = int8_rounded(x).double() @ dequantize(blocks, qtype, k).double().T
    for isa in ("native", *variant_isas()):
        op = getattr(kernel if isa == "native" else integer_kernels(isa), PACKS[qtype][2])
        error = (op(x, *packs(linear), n).double() - want).abs().max()
        assert error <= (0 if qtype in ("Q5_0", "Q5_1") else 1e-6 * want.abs().max()), isa
