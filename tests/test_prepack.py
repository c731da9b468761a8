import copy

import pytest
import torch
from torch import nn

from sluice.service.engine.prepack import (
    PackedLinear,
    can_prepack,
    prepack_linears,
    stock_copy,
    unpack_linears,
)

pytestmark = pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.proj = nn.Linear(8, 12)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as in SmolLM2

    def forward(self, ids):
        return self.head(self.proj(self.embed(ids))[..., :8])


def test_packed_linears_compute_what_the_plain_ones_did_and_unpack_exactly():
    torch.manual_seed(0)
    model = Tiny().eval()
    ids = torch.randint(0, 50, (1, 7))
    plain_proj = model.proj.weight.detach().clone()
    embed_ptr = model.embed.weight.data_ptr()
    with torch.inference_mode():
        want = model(ids)
        assert prepack_linears(model) == 1  # the head tied to the embedding stays plain: no second copy of it
        # the rest is copied, so a safetensors memory map behind the original weights can be released
        assert model.embed.weight.data_ptr() != embed_ptr and model.head.weight is model.embed.weight
        assert prepack_linears(model) == 0  # idempotent: nothing left to pack
        assert isinstance(model.proj, PackedLinear) and type(model.head) is nn.Linear
        assert "proj.weight" not in model.state_dict()  # the plain weight is gone, not kept beside the packed one
        torch.testing.assert_close(model(ids), want)
        for rows in (1, 3, 64, 300):  # any row count works whatever the packing hint
            x = torch.randn(rows, 8)
            torch.testing.assert_close(model.proj(x), x @ plain_proj.T + model.proj.bias)
        twin = copy.deepcopy(model)  # opaque tensors cannot be deep-copied; PackedLinear repacks
        torch.testing.assert_close(twin(ids), want)
        stock = stock_copy(model)
        assert type(stock.proj) is nn.Linear and torch.equal(stock.proj.weight, plain_proj)
        torch.testing.assert_close(stock(ids), want)
        unpack_linears(model)
        assert type(model.head) is nn.Linear and torch.equal(model.head.weight, model.embed.weight)


def test_prepack_only_where_onednn_applies():
    from sluice.service.engine import packed_gemv

    assert can_prepack(torch.device("cpu"), torch.bfloat16) == packed_gemv.bf16_native()
    assert not can_prepack(torch.device("cpu"), torch.float16)
    assert not can_prepack(torch.device("cuda"), torch.float32)


def test_row_counts_are_padded_to_a_few_shapes():
    from sluice.service.engine.prepack import padded_rows

    sizes = [padded_rows(m) for m in range(1, 2049)]
    assert all(padded_rows(m) >= m for m in range(1, 2049))
    assert sizes == sorted(sizes)
    assert len(set(sizes)) <= 24  # one cached oneDNN kernel per shape and linear size, not one per token count
    assert [padded_rows(m) for m in (1, 16, 64, 256, 2048)] == [1, 16, 64, 256, 2048]  # the common shapes: exact
