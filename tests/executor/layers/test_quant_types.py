"""The quant-type table: csrc/gguf_linear.cpp's kQuantTypes agrees with quant_types.py row for row (and both with the
gguf package), and a type's row serves, IQ4_NL's here (its packed kernel is test_packed_types'): its dequantizer
against the gguf package's, its GEMV on the blocks as stored and its prefill tiles against float matmul, its blocks
read from a .gguf file as stored."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.service.executor.layers.gguf_blocks import GgufBlocks
from sluice.service.executor.layers.gguf_linear import GgufLinear
from sluice.service.executor.layers.quant_types import (
    QUANT_TYPES,
    STORED_MAX_ROWS,
    dequantize,
    quant_type,
)
from sluice.service.executor.models import gguf_weights
from tests.support.gguf_files import random_blocks, reference_dequantize
from tests.support.int8_rounding import int8_rounded


def test_the_cpp_table_mirrors_the_python_one(kernel):
    cpp = {row[1]: row for row in kernel.quant_types()}
    assert sorted(cpp) == sorted(QUANT_TYPES)
    for type_id, t in QUANT_TYPES.items():
        name, _, block_size, block_bytes, packed = cpp[type_id]
        assert (name, block_size, block_bytes) == (t.name, t.block_size, t.block_bytes)
        assert packed == (t.packing is not None), name  # a packing here, a packed kernel there


def test_the_table_agrees_with_the_gguf_package():
    import gguf

    for t in QUANT_TYPES.values():
        ggml = gguf.GGMLQuantizationType[t.name]
        assert ggml.value == t.type_id and gguf.GGML_QUANT_SIZES[ggml] == (t.block_size, t.block_bytes)


def test_types_outside_the_table_are_refused(kernel):
    with pytest.raises(ValueError, match="no GGUF quant type 'IQ2_XS'"):
        quant_type("IQ2_XS")
    with pytest.raises(RuntimeError, match="no kernels for GGML type 99"):
        kernel.gguf_linear(torch.randn(1, 32), torch.zeros(1, 18, dtype=torch.uint8), 99)


def iq4_nl_blocks(n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [n, k / 32 * 18]: random level indices, small float16 d (elements around 0.1)."""
    return random_blocks("IQ4_NL", n, k, seed)


def reference(blocks: np.ndarray) -> torch.Tensor:
    return reference_dequantize(blocks, "IQ4_NL")


def test_iq4_nl_dequantizes_as_the_gguf_package_does():
    blocks = iq4_nl_blocks(24, 512, seed=0)
    assert torch.equal(dequantize(torch.from_numpy(blocks), "IQ4_NL", 512), reference(blocks))  # the same ops


@pytest.mark.parametrize("rows", [1, 5, STORED_MAX_ROWS])
def test_iq4_nl_decodes_on_the_gemv_of_its_blocks_as_stored(rows, kernel):
    n, k = 40, 768
    blocks = iq4_nl_blocks(n, k, seed=rows)
    weight = reference(blocks)
    torch.testing.assert_close(dequantize(torch.from_numpy(blocks), "IQ4_NL", k, kernel), weight, rtol=2e-7,
                               atol=1e-9)
    linear = GgufLinear(GgufBlocks(torch.from_numpy(blocks), "IQ4_NL", k), None, kernel, repack=False)
    assert not linear.method.packed and linear.method.max_rows == STORED_MAX_ROWS  # as stored
    assert linear.kernel_facts().op is not None  # csrc/llama_layer.cpp finds its GEMV by its id
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = linear(x)
    # Against the same int8-rounded activations the products are exact integers: only float summation order differs
    # (and, rarely, an activation within an ulp of a rounding tie).
    exact = int8_rounded(x) @ weight.T
    scale = (x.abs() @ weight.abs().T).amax()
    assert ((got - exact).abs() > 1e-5 * scale).sum() <= max(1, got.numel() // 40)


@pytest.mark.parametrize("native", [True, False])
def test_iq4_nl_prefills_on_float_tiles(native, kernel):
    n, k = 300, 512
    blocks = iq4_nl_blocks(n, k, seed=7)
    linear = GgufLinear(GgufBlocks(torch.from_numpy(blocks), "IQ4_NL", k), torch.randn(n), kernel if native else None,
                        repack=False)
    linear.method.tile_rows = 64  # several tiles, the last one partial
    x = torch.randn(2, 17, k)  # 34 rows: past the GEMV's
    torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, reference(blocks), linear.bias), rtol=1e-5,
                               atol=1e-4)


def test_a_gguf_file_of_iq4_nl_reads_as_stored(tmp_path):
    import gguf
    import transformers

    blocks = iq4_nl_blocks(64, 256, seed=3)
    path = tmp_path / "iq4_nl.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = transformers.LlamaConfig(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    tensor = gguf_weights.read_tensors(path, config)("model.layers.0.mlp.down_proj.weight")
    assert (tensor.qtype, tensor.in_features) == ("IQ4_NL", 256) and torch.equal(tensor.data, torch.from_numpy(blocks))
