"""The GEMV that reads oneDNN's packed weights in place: layout recognition, numerics, and which calls take it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sluice import native
from sluice.service.executor import packed_gemv
from sluice.service.executor.layers import packed_linear
from sluice.service.executor.layers.linear import padded_rows
from sluice.service.executor.layers.packed_linear import PackedLinear, can_prepack
from tests.support.kernels import MARCHES, build_variant, variant_isas


def packed_of(linear: nn.Linear) -> PackedLinear:
    return PackedLinear(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())


pytestmark = pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch")

DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not packed_gemv.bf16_native(), reason="this CPU has no AVX512_BF16"))]


def tolerance(dtype):
    return {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 2e-2}


@pytest.mark.parametrize("out_features,in_features", [(1536, 576), (576, 1536), (576, 576), (2048, 2048)])
def test_model_shaped_fp32_weights_take_the_gemv(kernel, out_features, in_features):
    """SmolLM2's and the 1.7B's linears: oneDNN packs them in a layout the GEMV reads (AVX2 and AVX-512 alike)."""
    assert packed_of(nn.Linear(in_features, out_features)).method.gemv_layout is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features,in_features", [(192, 576), (576, 64), (100, 70), (8, 32), (130, 7)])
def test_packed_linear_matches_the_plain_one_on_both_paths(kernel, dtype, out_features, in_features):
    torch.manual_seed(out_features + in_features)
    linear = nn.Linear(in_features, out_features).to(dtype)
    plain = nn.Linear(in_features, out_features).to(dtype)
    plain.load_state_dict(linear.state_dict())
    packed = PackedLinear(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
    if packed.method.gemv_layout is None:  # oneDNN chose blocks narrower than the GEMV reads (AVX2, some shapes)
        assert packed.method.max_rows == 0  # oneDNN alone serves every call
    else:
        packed.method.max_rows = 32  # the GEMV's numerics at every row count, whatever this CPU measured
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 5, 9, packed.method.max_rows, packed.method.max_rows + 1, 70):
            x = torch.randn(2, rows, in_features).to(dtype)
            want = nn.functional.linear(x.double(), plain.weight.double(), plain.bias.double())
            torch.testing.assert_close(packed(x).double(), want, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features", [1000, 64 * 9, 70])
def test_one_row_comes_out_as_in_a_two_row_call(kernel, dtype, out_features):
    """A row's columns sum in the same order whether the call has one row (whole blocks a pass) or two (chunks of
    rows): bit for bit the same row, over many blocks per thread and a short last one."""
    torch.manual_seed(out_features)
    linear = nn.Linear(96, out_features, bias=False).to(dtype)
    packed = packed_of(linear)
    if packed.method.gemv_layout is None:
        pytest.skip("oneDNN chose a layout the GEMV does not read")
    packed.method.max_rows = 32
    x = torch.randn(2, 96).to(dtype)
    with torch.inference_mode():
        one, two = packed(x[:1]), packed(x)
    assert torch.equal(one[0], two[0])
    torch.testing.assert_close(one.double(), x[:1].double() @ linear.weight.double().T, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_sized_calls_take_the_gemv_and_larger_ones_onednn(kernel, dtype, monkeypatch):
    linear = packed_of(nn.Linear(64, 128, bias=False).to(dtype))
    gemv_rows, onednn_rows = [], []
    real_gemv, real_onednn = packed_gemv.gemv, torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(packed_gemv, "gemv", lambda x, *a: gemv_rows.append(x.shape[0]) or real_gemv(x, *a))
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, *a: onednn_rows.append(x.shape[0]) or real_onednn(x, *a), raising=False)
    limit = linear.method.max_rows = 16  # the routing, whatever packed_max_rows measured here
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
    block, k_rows = packed_gemv.gemv_layout(packed, weight)
    assert block in (32, 64) and k_rows == 64  # 32-column bf16 blocks where oneDNN packs for AMX
    assert packed_gemv.gemv_layout(packed, weight.flip(0)) is None  # other values: the GEMV would read garbage
    assert packed_gemv.gemv_layout(packed, weight.to(torch.float16)) is None  # no GEMV for this dtype


def test_no_gemv_without_the_cpu_ops(monkeypatch):
    monkeypatch.setattr(packed_gemv.native, "load", lambda: None)
    plain = nn.Linear(64, 128)
    linear = packed_of(plain)
    assert linear.method.gemv_layout is None and linear.method.max_rows == 0
    x = torch.randn(1, 64)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x), plain(x))


def test_crossover_keeps_the_rows_up_to_the_first_step_the_kernel_loses():
    from sluice.service.executor.layers import crossover

    def run(kernel_ms, gemm_ms):
        def timer(call):
            kind, rows = call()
            return kernel_ms(rows) if kind == "kernel" else gemm_ms(rows)
        return crossover.crossover(lambda x: ("kernel", x.shape[0]), lambda x: ("gemm", x.shape[0]), 8,
                                   torch.float32, timer=timer)

    assert run(lambda r: 1.0 * r, lambda r: 6.0) == 5  # 1 to 5 rows win; 6 ties, which loses
    assert run(lambda r: 1.0 * r, lambda r: 0.5) == 0  # oneDNN wins from one row: the GEMV is never taken
    assert run(lambda r: 0.1, lambda r: 1.0) == crossover.ROW_STEPS[-1]
    assert run(lambda r: 1.0 if r != 2 else 9.0, lambda r: 2.0) == 1  # a later win past a loss does not count


def test_crossover_takes_each_sides_best_of_rounds_timed_in_turn():
    from sluice.service.executor.layers import crossover

    order, kernel_calls = [], []

    def timer(call):
        kind, rows = call()
        order.append(kind)
        if kind == "gemm":
            return 2.0
        kernel_calls.append(rows)
        return 9.0 if len(kernel_calls) == 1 else 1.0  # a burst of other work slows the first kernel timing alone

    limit = crossover.crossover(lambda x: ("kernel", x.shape[0]), lambda x: ("gemm", x.shape[0]), 8, torch.float32,
                                timer=timer)
    assert limit == crossover.ROW_STEPS[-1]  # one slow timing no longer sends decoding to oneDNN
    assert order[:4] == ["kernel", "gemm", "kernel", "gemm"]
    assert len(order) == 2 * crossover.ROUNDS * len(crossover.ROW_STEPS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_measured_row_limits_are_steps_and_layers_use_them(kernel, dtype):
    from sluice.service.executor.layers.crossover import ROW_STEPS
    from sluice.service.executor.layers.linear import PlainLinear, plain_max_rows

    limit = packed_linear.packed_max_rows(dtype, (128, 64))
    assert limit in (0, *ROW_STEPS) and packed_linear.packed_max_rows(dtype, (128, 64)) == limit  # measured once
    assert packed_of(nn.Linear(64, 128, bias=False).to(dtype)).method.max_rows == limit  # per shape
    plain = plain_max_rows(dtype, (8, 64))
    assert plain in (0, *ROW_STEPS)
    weight = torch.randn(8, 64).to(dtype)
    assert PlainLinear(weight, None, pad=True, decode_kernel=True).method.max_rows == plain
    assert PlainLinear(weight, None, pad=True).method.max_rows == 0


def test_a_limit_is_timed_once_per_machine_and_kept_for_the_next_start(tmp_path, monkeypatch):
    import json

    from sluice.service.executor.layers import crossover

    timed = []

    def measure(limit):
        return lambda: timed.append(limit) or limit

    assert crossover.kept_limit("packed bf16 960x576", measure(12), tmp_path) == 12
    assert crossover.kept_limit("packed bf16 960x576", measure(3), tmp_path) == 12  # read back, not timed
    assert crossover.kept_limit("plain bf16 49152x576", measure(32), tmp_path) == 32  # another shape: timed
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)  # another machine's (or thread count's) own entry
    assert crossover.kept_limit("packed bf16 960x576", measure(4), tmp_path) == 4
    assert timed == [12, 32, 4]
    kept = json.loads((tmp_path / crossover.KEPT_FILE).read_text())
    assert sorted(len(v) for v in kept.values()) == [1, 2] and not list(tmp_path.glob(".crossovers-*"))
    (tmp_path / crossover.KEPT_FILE).write_text("{not json")  # a torn or foreign file: timed again, rewritten
    assert crossover.kept_limit("packed bf16 960x576", measure(5), tmp_path) == 5
    assert crossover.kept_limit("packed bf16 960x576", measure(6), tmp_path) == 5
    assert crossover.kept_limit("plain f32 8x8", measure(1), tmp_path / "absent") == 1  # unwritable: timed, no error


def test_probe_weights_stream_past_the_last_level_cache(monkeypatch):
    from sluice.service.executor.layers import crossover

    monkeypatch.setattr(crossover, "last_level_cache_bytes", lambda: 1 << 20)
    narrow = crossover.probe_weights((512, 256), torch.float32)  # 512 KiB each: 4 copies make twice the cache
    assert len(narrow) == 4 and all(w.shape == (512, 256) for w in narrow)
    assert not torch.equal(narrow[0], narrow[1])  # distinct bytes: no copy is served from another's cache lines
    wide = crossover.probe_weights((49152, 576), torch.float32)  # a head: rows cut to whole blocks, one copy
    assert len(wide) == 1 and wide[0].shape[1] == 576 and wide[0].shape[0] % 64 == 0
    assert 2 << 20 <= wide[0].numel() * 4 < (2 << 20) + 64 * 576 * 4
    tiny = crossover.probe_weights((64, 32), torch.bfloat16)  # a model of such linears lives in the caches
    assert len(tiny) == 1 and tiny[0].dtype == torch.bfloat16


def test_last_level_cache_is_the_largest_sysfs_cache(tmp_path):
    from sluice.service.executor.layers import crossover

    for index, size in (("index0", "32K"), ("index2", "512K"), ("index3", "32768K\n"), ("index4", "bogus")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size)
    assert crossover.largest_cache_bytes(tmp_path) == 32 << 20
    assert crossover.largest_cache_bytes(tmp_path / "absent") is None
    assert crossover.last_level_cache_bytes() > 0


@pytest.mark.deep  # slow (builds or a long end-to-end run): `make test-deep`
@pytest.mark.parametrize("isa", variant_isas())
@pytest.mark.parametrize("block", [64, 128])
def test_f32_gemv_of_every_instruction_set_reads_each_row(isa, block):
    """packed_linear.cpp built portable and for AVX2, on a block layout made by hand: one row (whole blocks per
    pass) and several (chunks of the block per pass) both match x @ W.T."""
    binding = ('#include <torch/library.h>\n#include "cpu_ops.h"\n'
               f'TORCH_LIBRARY(sluice_test_f32_{isa}, m) {{ m.def("packed_linear_f32", &packed_linear_f32); }}\n')
    build_variant(f"f32_{isa}", ["packed_linear.cpp"], binding, ["-O3", MARCHES[isa], *native.OPENMP_FLAGS],
                  python_module=False)
    run = getattr(torch.ops, f"sluice_test_f32_{isa}").packed_linear_f32
    n_out, k_in = 200, 96
    weight = torch.randn(n_out, k_in, generator=torch.Generator().manual_seed(block))
    blocks = -(-n_out // block)
    padded = torch.zeros(blocks * block, k_in)
    padded[:n_out] = weight
    packed = padded.view(blocks, block, k_in).transpose(1, 2).contiguous()  # w[n, k] at (n / B) B K + k B + n % B
    for rows in (1, 2, 3, 5):
        x = torch.randn(rows, k_in)
        torch.testing.assert_close(run(x, packed.data_ptr(), n_out, block, k_in), x @ weight.T, rtol=1e-5, atol=1e-4)
