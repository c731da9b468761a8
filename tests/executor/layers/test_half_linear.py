"""16-bit weights times float32 activations (`--quantization f16 | bf16`): the widening GEMV in every instruction set
against float64 on the rounded weights, the large-call path in one piece and in several, the fused layer's linear,
and engines on tiny Llama, Qwen2 (biases) and Qwen3 (q/k norms) models against transformers on the same rounded
weights."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import sluice.service.executor.layers.half_linear as half_linear
from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.config import SluiceConfig
from sluice.service.engine.engine import LLMEngine
from sluice.service.executor.layers.half_linear import HalfEmbedding, HalfFormat, HalfLinear
from tests.support import tiny
from tests.support.int8_rounding import greedy_gaps
from tests.support.kernels import MARCHES, build_variant, variant_isas
from tests.support.parity import MAX_NEW, build_pair, mixed_prompts

HALVES = [torch.float16, torch.bfloat16]


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double().mm(w.double().T).float()


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16])
# 70 and 7: tails after the 8-wide loops; 1030 and 2053: rows read several at once, with tails
@pytest.mark.parametrize("in_features", [32, 576, 70, 7, 1030, 2053])
def test_the_gemv_widens_16_bit_weights_exactly(kernel, half, rows, in_features):
    torch.manual_seed(rows * 100 + in_features)
    x, w = torch.randn(rows, in_features), torch.randn(130, in_features).to(half)
    got = kernel.f32_linear(x, w)
    assert got.shape == (rows, 130) and got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(x, w), rtol=1e-5, atol=1e-4)


def _f32_linear(isa: str):
    """f32_linear.cpp built for `isa` (a key of MARCHES) as a torch op."""
    binding = ('#include <torch/library.h>\n#include "cpu_ops.h"\n'
               f'TORCH_LIBRARY(sluice_test_plain_{isa}, m) {{ m.def("f32_linear", &f32_linear); }}\n')
    build_variant(f"plain_{isa}", ["f32_linear.cpp"], binding, ["-O3", MARCHES[isa]], python_module=False)
    return getattr(torch.ops, f"sluice_test_plain_{isa}").f32_linear


@pytest.mark.deep  # slow (builds or a long end-to-end run): `make test-deep`
@pytest.mark.parametrize("half", HALVES)
def test_every_instruction_set_widens_the_same_weights(half):
    # The portable loop converts one element at a time (c10's conversions), AVX2 eight (F16C, a shift for bf16).
    torch.manual_seed(0)
    x, w = torch.randn(5, 70), torch.randn(40, 70).to(half)
    w[0, :4] = torch.tensor([65504.0, -0.0, 6e-8, float("inf")]).to(half)  # largest, signed zero, subnormal, inf
    for isa in variant_isas():
        got = _f32_linear(isa)(x, w)
        torch.testing.assert_close(got, _reference(x, w), rtol=1e-5, atol=1e-4, msg=isa)


def test_the_gemv_refuses_what_it_cannot_read(kernel):
    with pytest.raises(RuntimeError, match="f32_linear"):
        kernel.f32_linear(torch.randn(2, 8).half(), torch.randn(4, 8).half())  # 16-bit activations
    with pytest.raises(RuntimeError, match="f32_linear"):
        kernel.f32_linear(torch.randn(2, 8), torch.randn(8, 4).half().T)  # a strided weight
    with pytest.raises(RuntimeError, match="16-bit"):
        kernel.LayerLinear(torch.randn(4, 8), None)  # a float32 weight is not a 16-bit one


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("rows", [1, 7, 33, 130])
def test_a_linear_keeps_16_bits_and_computes_in_float32_at_any_row_count(kernel, monkeypatch, half, rows):
    torch.manual_seed(rows)
    w, bias = torch.randn(100, 64), torch.randn(100)
    linear = HalfLinear(w, bias, half, kernel)
    assert linear.weight.dtype == half and linear.bias.dtype == torch.float32
    assert linear.method.max_rows <= max(half_linear.ROW_STEPS)  # timed here: where the GEMV stops winning
    x = torch.randn(rows, 64)
    want = _reference(x, w.to(half)) + bias
    linear.method.max_rows = rows  # on the GEMV
    torch.testing.assert_close(linear(x), want, rtol=1e-5, atol=1e-4)
    # Past the GEMV: the weight widened into the scratch in several pieces (a small scratch) or one.
    linear.method.max_rows = 0
    torch.testing.assert_close(linear(x), want, rtol=1e-5, atol=1e-4)
    monkeypatch.setattr(half_linear, "SCRATCH_ELEMENTS", 64 * 30)
    torch.testing.assert_close(linear(x), want, rtol=1e-5, atol=1e-4)


def test_the_embedding_and_a_tied_head_share_one_16_bit_table(kernel):
    table = torch.randn(50, 64)
    formats = HalfFormat("f16", kernel)
    embed = formats.embedding(table, torch.device("cpu"), torch.float32)
    head = formats.tied_head(embed)
    assert isinstance(embed, HalfEmbedding) and embed.weight.dtype == torch.float16
    assert head.weight.data_ptr() == embed.weight.data_ptr()  # one copy of the bytes
    ids = torch.tensor([[3, 0, 49]])
    assert embed(ids).dtype == torch.float32
    torch.testing.assert_close(embed(ids), table.half().float()[ids])
    fused = formats.make_parts([torch.randn(8, 64), torch.randn(4, 64)], [None, None], ["q", "k"],
                               torch.device("cpu"), torch.float32)
    assert fused.weight.dtype == torch.float16 and fused.out_features == 12
    assert "f16" in formats.describe()


def _rounded_twin(model: nn.Module, half: torch.dtype) -> nn.Module:
    """A copy of `model` with every linear's and the embedding's weight rounded to `half` (kept in float32)."""
    twin = copy.deepcopy(model)
    for module in twin.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            module.weight.data = module.weight.data.to(half).float()
    return twin


def half_engine(model, quantization: str, budget: int, dtype: str = "auto") -> LLMEngine:
    cfg = SluiceConfig()
    cfg.model.device, cfg.model.dtype, cfg.model.quantization = "cpu", dtype, quantization
    cfg.cache.num_kv_blocks = 64
    cfg.scheduler.max_num_batched_tokens = budget
    cfg.scheduler.max_num_seqs = 16
    return LLMEngine(cfg, model=model, tokenizer=tiny.tokenizer())


@pytest.mark.parametrize(("arch", "quantization"), [("llama", "f16"), ("qwen2", "bf16"), ("qwen3", "f16")])
def test_engine_matches_transformers_on_the_rounded_weights(kernel, arch, quantization):
    half = half_linear.HALF_DTYPES[quantization]
    reference, ours = build_pair(arch)
    reference = _rounded_twin(reference, half)
    engine = half_engine(ours, quantization, budget=8)  # chunked prefill, decode batches of up to 8 rows
    linears = [m for m in engine.model.modules() if isinstance(m, HalfLinear)]
    assert linears and all(m.weight.dtype == half for m in linears)
    assert all(type(m) is not nn.Linear for m in engine.model.modules())
    assert engine.model.layers[0]._layer_ops is not None  # decode steps run the fused layer on the GEMV
    prompts = mixed_prompts(12)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    got = [c.token_ids for c in engine.generate(prompts, params)]
    gaps = greedy_gaps(reference, prompts, got)  # float32 arithmetic on the same weights: only near-ties may part
    assert (gaps <= 1e-3).all(), gaps.max()


def test_16_bit_weights_need_cpu_float32():
    _, ours = build_pair("llama")
    with pytest.raises(ValueError, match="float32"):
        half_engine(ours, "f16", 64, dtype="bfloat16")
