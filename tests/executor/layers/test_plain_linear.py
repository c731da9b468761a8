"""Decode linears on plain weights: the fp32 and AVX512_BF16 GEMV kernels against torch, and which calls take them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sluice.service.executor.layers.linear as decode
from sluice.service.executor.layers.linear import PlainLinear, padded_rows


@pytest.fixture(scope="module")
def native(kernel):
    if not kernel.bf16_linear_is_native():
        pytest.skip("this CPU has no AVX512_BF16")
    return kernel


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16])
# 70 and 7: tails after the 8-wide loops; 1030 and 2053: rows long enough to be read several at once (past 3 and
# 8 KiB), with tails, and 130 outputs leave a thread's last few weight rows to the one-row loop
@pytest.mark.parametrize("in_features", [32, 576, 70, 7, 1030, 2053])
def test_f32_kernel_matches_torch(kernel, rows, in_features):
    torch.manual_seed(rows * 100 + in_features)
    x, w = torch.randn(rows, in_features), torch.randn(130, in_features)
    got = kernel.f32_linear(x, w)
    assert got.shape == (rows, 130) and got.dtype == torch.float32
    torch.testing.assert_close(got, x.double().mm(w.double().T).float(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [5, 9, 13])
def test_f32_kernel_rows_past_one_block_share_weight_tiles(kernel, rows):
    # Past four rows the row blocks take turns on tiles of ~128 KiB of weight rows (56 of 576 inputs): 1,000
    # outputs split over the threads end tiles mid-range and leave short last tiles.
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 576), torch.randn(1000, 576)
    torch.testing.assert_close(kernel.f32_linear(x, w), x.double().mm(w.double().T).float(), rtol=1e-5, atol=1e-4)


def test_f32_kernel_refuses_what_it_cannot_read(kernel):
    with pytest.raises(RuntimeError, match="f32_linear"):
        kernel.f32_linear(torch.randn(2, 8), torch.randn(8, 4))  # [M, K] against [N, K] with another K
    with pytest.raises(RuntimeError, match="f32_linear"):
        kernel.f32_linear(torch.randn(2, 8), torch.randn(8, 4).T)  # a strided weight


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16])
@pytest.mark.parametrize("in_features", [32, 96, 576, 70])  # 96 and 70: tails after the 64- and 32-wide loops
def test_bf16_kernel_matches_a_float32_reference_to_bf16_rounding(native, rows, in_features):
    torch.manual_seed(rows * 100 + in_features)
    x, w = torch.randn(rows, in_features).bfloat16(), torch.randn(130, in_features).bfloat16()
    want = torch.nn.functional.linear(x.float(), w.float())
    got = native.bf16_linear(x, w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-2)  # one bf16 rounding of the result


def _recording_ops(monkeypatch, kernel, calls):
    """native.load() as seen by layers/linear.py, recording the row count of each kernel call."""
    def wrap(fn):
        return staticmethod(lambda x, w: calls.append((fn.__name__, x.shape[0])) or fn(x, w))
    fake = type("Ops", (), {"f32_linear": wrap(kernel.f32_linear), "bf16_linear": wrap(kernel.bf16_linear)})
    monkeypatch.setattr(decode.native, "load", lambda: fake)


def test_f32_decode_linear_takes_the_kernel_up_to_its_limit_and_onednn_on_the_plain_weight_above(kernel, monkeypatch):
    if not decode.onednn_linear_available():
        pytest.skip("no oneDNN linear in this torch")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 8, bias=False))
    reference = [nn.Linear(64, 48), nn.Linear(48, 8, bias=False)]
    for a, b in zip(reference, model, strict=True):
        a.load_state_dict(b.state_dict())
    model = nn.Sequential(*(PlainLinear(m.weight.detach(), None if m.bias is None else m.bias.detach(), pad=True,
                                        decode_kernel=True) for m in model))
    limit = 16  # whatever this CPU measured (plain_max_rows), the routing is the same
    for layer in model:
        layer.method.max_rows = limit
    calls, onednn = [], []
    _recording_ops(monkeypatch, kernel, calls)
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(decode.torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, *a: onednn.append(x.shape[0]) or real(x, *a), raising=False)
    with torch.inference_mode():
        for rows in (1, 3, limit, limit + 1, 100):
            x = torch.randn(2, rows, 64)
            torch.testing.assert_close(model(x), reference[1](reference[0](x)), rtol=1e-5, atol=1e-5)
    kernel_rows = [2 * r for r in (1, 3) if 2 * r <= limit]
    assert calls == [("f32_linear", r) for r in kernel_rows for _ in range(2)]
    # above the limit: oneDNN, fed padded row counts only (it builds a kernel per shape)
    big = [2 * r for r in (1, 3, limit, limit + 1, 100) if 2 * r > limit]
    assert onednn == [padded_rows(r) for r in big for _ in range(2)]


def test_bf16_decode_linear_takes_the_kernel_up_to_its_limit_and_torch_above(native, monkeypatch):
    plain = nn.Linear(64, 48, dtype=torch.bfloat16)
    model = [PlainLinear(plain.weight.detach(), plain.bias.detach(), pad=True, decode_kernel=True)]
    padded_only = PlainLinear(plain.weight.detach(), plain.bias.detach(), pad=True)
    limit = model[0].method.max_rows = 16
    calls = []
    _recording_ops(monkeypatch, native, calls)
    with torch.inference_mode():
        for rows in (1, limit, limit + 1):
            x = torch.randn(1, rows, 64).bfloat16()
            want = padded_only(x)
            torch.testing.assert_close(model[0](x).float(), want.float(), rtol=2**-7, atol=2e-2)
    assert calls == [("bf16_linear", 1), ("bf16_linear", limit)]  # above the limit: torch's path
