"""The GEMV that reads oneDNN's packed weights in place: layout recognition, numerics, and which calls take it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sluice.service.engine import packed_gemv
from sluice.service.engine.layers.packed_linear import PackedLinear, can_prepack, padded_rows


def packed_of(linear: nn.Linear) -> PackedLinear:
    return PackedLinear(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())


pytestmark = pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch")

DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not packed_gemv.bf16_native(), reason="this CPU has no AVX512_BF16"))]


def tolerance(dtype):
    return {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features,in_features", [(192, 576), (576, 64), (100, 70), (8, 32), (130, 7)])
def test_packed_linear_matches_the_plain_one_on_both_paths(kernel, dtype, out_features, in_features):
    torch.manual_seed(out_features + in_features)
    linear = nn.Linear(in_features, out_features).to(dtype)
    plain = nn.Linear(in_features, out_features).to(dtype)
    plain.load_state_dict(linear.state_dict())
    packed = PackedLinear(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
    assert packed.gemv_layout is not None  # oneDNN's layout here, K padded or not, is one the GEMV reads
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 5, 9, packed.gemv_max_rows, packed.gemv_max_rows + 1, 70):
            x = torch.randn(2, rows, in_features).to(dtype)
            want = nn.functional.linear(x.double(), plain.weight.double(), plain.bias.double())
            torch.testing.assert_close(packed(x).double(), want, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_sized_calls_take_the_gemv_and_larger_ones_onednn(kernel, dtype, monkeypatch):
    linear = packed_of(nn.Linear(64, 128, bias=False).to(dtype))
    gemv_rows, onednn_rows = [], []
    real_gemv, real_onednn = packed_gemv.gemv, torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(packed_gemv, "gemv", lambda x, *a: gemv_rows.append(x.shape[0]) or real_gemv(x, *a))
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, *a: onednn_rows.append(x.shape[0]) or real_onednn(x, *a), raising=False)
    limit = packed_gemv.MAX_ROWS[dtype]
    with torch.inference_mode():
        for rows in (1, limit, limit + 1, 100):
            linear(torch.randn(rows, 64).to(dtype))
    assert gemv_rows == [1, limit]
    assert onednn_rows == [padded_rows(limit + 1), padded_rows(100)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_layout_that_does_not_match_the_weight_is_refused(kernel, dtype):
    torch.manual_seed(0)
    weight = torch.randn(128, 64).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    assert packed_gemv.gemv_layout(packed, weight) == (64, 64)
    assert packed_gemv.gemv_layout(packed, weight.flip(0)) is None  # other values: the GEMV would read garbage
    assert packed_gemv.gemv_layout(packed, weight.to(torch.float16)) is None  # no GEMV for this dtype


def test_no_gemv_without_the_cpu_ops(monkeypatch):
    monkeypatch.setattr(packed_gemv.native, "load", lambda: None)
    plain = nn.Linear(64, 128)
    linear = packed_of(plain)
    assert linear.gemv_layout is None and linear.gemv_max_rows == 0
    x = torch.randn(1, 64)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x), plain(x))
