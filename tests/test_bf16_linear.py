"""bf16 decode linears: the AVX512_BF16 kernel against torch's own bf16 linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sluice.service.engine.bf16_linear as bf16
from sluice.service.engine.prepack import PaddedLinear, pad_linear_rows


@pytest.fixture(scope="module")
def native(kernel):
    if not kernel.bf16_linear_is_native():
        pytest.skip("this CPU has no AVX512_BF16")
    return kernel


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16])
@pytest.mark.parametrize("in_features", [32, 96, 576, 70])  # 96 and 70: tails after the 64- and 32-wide loops
def test_kernel_matches_a_float32_reference_to_bf16_rounding(native, rows, in_features):
    torch.manual_seed(rows * 100 + in_features)
    x, w = torch.randn(rows, in_features).bfloat16(), torch.randn(130, in_features).bfloat16()
    want = torch.nn.functional.linear(x.float(), w.float())
    got = native.bf16_linear(x, w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-2)  # one bf16 rounding of the result


def test_decode_linear_takes_the_kernel_up_to_its_limit_and_torch_above(native, monkeypatch):
    model = nn.Sequential(nn.Linear(64, 48, dtype=torch.bfloat16), nn.Linear(48, 8, bias=False, dtype=torch.bfloat16))
    pad_linear_rows(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert bf16.use_bf16_kernel(model) == 2 and isinstance(model[0], bf16.Bf16DecodeLinear)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())  # same weights, not copies
    calls = []
    real = native.bf16_linear
    monkeypatch.setattr(bf16.cpu_ops, "load", lambda: type("Ops", (), {"bf16_linear": staticmethod(
        lambda x, w: calls.append(x.shape[0]) or real(x, w))}))
    with torch.inference_mode():
        for rows in (1, bf16.KERNEL_MAX_ROWS, bf16.KERNEL_MAX_ROWS + 1):
            x = torch.randn(1, rows, 64).bfloat16()
            want = PaddedLinear.forward(model[0], x)
            torch.testing.assert_close(model[0](x).float(), want.float(), rtol=2**-7, atol=2e-2)
    assert calls == [1, bf16.KERNEL_MAX_ROWS]  # the call above the limit took torch's path
