"""oneDNN-prepacked linears: what they compute, that the plain weight is not kept, and where prepacking applies."""

import copy

import pytest
import torch

from sluice.service.executor.layers.linear import PlainLinear, padded_rows
from sluice.service.executor.layers.packed_linear import PackedFormat, PackedLinear, can_prepack

pytestmark = pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch")


def test_packed_linears_compute_what_the_plain_ones_did_and_give_the_weight_back_exactly():
    torch.manual_seed(0)
    weight, bias = torch.randn(12, 8), torch.randn(12)
    with torch.inference_mode():
        packed = PackedLinear(weight, bias)
        assert "weight" not in packed.state_dict()  # the plain weight is gone, not kept beside the packed one
        for rows in (1, 3, 64, 300):  # any row count works whatever the packing hint
            x = torch.randn(rows, 8)
            torch.testing.assert_close(packed(x), x @ weight.T + bias)
        assert torch.equal(packed.dense_weight(), weight)
        twin = copy.deepcopy(packed)  # opaque tensors cannot be deep-copied; PackedLinear repacks
        x = torch.randn(2, 8)
        torch.testing.assert_close(twin(x), packed(x))


def test_the_packed_format_keeps_a_head_tied_to_the_embedding_plain():
    method = PackedFormat(torch.device("cpu"), torch.float32)
    embedding = torch.randn(50, 8)
    head = method.make(embedding, None, ["lm_head"], [50], tied=True)
    assert type(head) is PlainLinear and head.weight.data_ptr() == embedding.data_ptr()  # one copy
    assert type(method.make(torch.randn(12, 8), None, ["proj"], [12])) is PackedLinear


def test_prepack_only_where_onednn_applies():
    from sluice.service.executor import packed_gemv

    assert can_prepack(torch.device("cpu"), torch.bfloat16) == packed_gemv.bf16_native()
    assert not can_prepack(torch.device("cpu"), torch.float16)
    assert not can_prepack(torch.device("cuda"), torch.float32)


def test_row_counts_are_padded_to_a_few_shapes():
    sizes = [padded_rows(m) for m in range(1, 2049)]
    assert all(padded_rows(m) >= m for m in range(1, 2049))
    assert sizes == sorted(sizes)
    assert len(set(sizes)) <= 24  # one cached oneDNN kernel per shape and linear size, not one per token count
    assert [padded_rows(m) for m in (1, 16, 64, 256, 2048)] == [1, 16, 64, 256, 2048]  # the common shapes: exact
