"""The GGUF types without a kernel, rewritten at load by csrc/requantize.cpp: the one-pass requantization into Q8_0
giving the same bytes as the slow path it replaces (gguf's own dequantize, then `quantize` into Q8_0 blocks)."""

from __future__ import annotations

import pytest
import torch

from sluice.service.executor.layers.gguf_blocks import quantize
from tests.support.gguf_files import random_blocks, reference_dequantize
from tests.support.kernels import integer_kernels, variant_isas

REQUANTIZED = {"Q2_K": 10}  # GGML type ids


def test_the_kernels_read_the_types_the_file_names(kernel):
    import gguf

    assert sorted(kernel.requantized_types()) == sorted(REQUANTIZED.values())
    for name, type_id in REQUANTIZED.items():
        assert gguf.GGMLQuantizationType[name].value == type_id


@pytest.mark.parametrize("qtype", sorted(REQUANTIZED))
@pytest.mark.parametrize("shape", [(1, 256), (37, 512), (64, 1536)])
def test_requantized_blocks_are_the_slow_paths_bytes(kernel, qtype, shape):
    for seed in range(3):
        blocks = random_blocks(qtype, *shape, seed=seed)
        expected = quantize(reference_dequantize(blocks, qtype), "Q8_0")
        got = kernel.requantize_q8_0(torch.from_numpy(blocks), REQUANTIZED[qtype], shape[1])
        assert got.dtype == torch.uint8 and got.shape == expected.shape
        assert torch.equal(got, expected), (qtype, shape, seed, (got != expected).sum().item())


def test_a_zero_block_and_a_saturated_one(kernel):
    """d = 0 codes every weight 0 (no division by it); the largest weight of a block codes to ±127."""
    blocks = random_blocks("Q2_K", 4, 256)
    blocks[0] = 0
    got = kernel.requantize_q8_0(torch.from_numpy(blocks), REQUANTIZED["Q2_K"], 256)
    assert torch.equal(got, quantize(reference_dequantize(blocks, "Q2_K"), "Q8_0"))
    assert not got[0].any()
    codes = got[1:].reshape(-1, 34)[:, 2:].view(torch.int8)
    assert (codes.abs().amax(-1) == 127).all()


def test_bad_input_is_refused(kernel):
    blocks = torch.from_numpy(random_blocks("Q2_K", 2, 256))
    with pytest.raises(RuntimeError, match="no dequantizer for GGML type 12"):
        kernel.requantize_q8_0(blocks, 12, 256)
    with pytest.raises(RuntimeError, match="whole 256-weight blocks"):
        kernel.requantize_q8_0(blocks, REQUANTIZED["Q2_K"], 128)
    with pytest.raises(RuntimeError, match=r"w uint8 \[N, 168\]"):
        kernel.requantize_q8_0(blocks, REQUANTIZED["Q2_K"], 512)


def test_every_instruction_set_rewrites_the_same(kernel):
    """The portable loops and the AVX2 build (where this CPU runs it) give the native build's bytes."""
    blocks = {qtype: torch.from_numpy(random_blocks(qtype, 19, 512, seed=5)) for qtype in REQUANTIZED}
    want = {qtype: kernel.requantize_q8_0(blocks[qtype], type_id, 512) for qtype, type_id in REQUANTIZED.items()}
    for isa in variant_isas():
        ops = integer_kernels(isa)
        for qtype, type_id in REQUANTIZED.items():
            assert torch.equal(ops.requantize_q8_0(blocks[qtype], type_id, 512), want[qtype]), (isa, qtype)
