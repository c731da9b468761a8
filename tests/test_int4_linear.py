"""--quantization int4 (Q4_1 layout): quantization, the kernel against plain torch, and the int4 engine against
transformers on the same dequantized weights (only the weights' precision changes, so the oracle stays exact)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import sluice.service.engine.int4_linear as int4
from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.config import SluiceConfig
from sluice.service.engine.engine import LLMEngine
from sluice.service.engine.int8_linear import Int8Linear
from sluice.service.engine.int8_linear import dequantize as int8_dequantize
from sluice.service.engine.int8_linear import quantize_weight as int8_weight
from tests import _tiny
from tests.test_parity import MAX_NEW, build_pair, hf_greedy, mixed_prompts


def test_quantize_rounds_to_within_half_a_step_of_the_stored_scale_and_minimum():
    torch.manual_seed(0)
    w = torch.randn(9, 96) * torch.linspace(0.01, 3, 9)[:, None]
    w[4, 32:64] = 0.5  # a constant group: zero range, every element must come back exactly
    nibbles, scale, minimum = int4.quantize_weight(w)
    assert nibbles.dtype == torch.uint8 and nibbles.shape == (9, 3, 16)
    assert scale.dtype == minimum.dtype == torch.float16 and scale.shape == (9, 3)
    back = int4.dequantize(nibbles, scale, minimum)
    step = scale.float().repeat_interleave(32, dim=1)
    # half a step, plus the float16 rounding of the stored minimum
    assert ((back - w).abs() <= step / 2 + minimum.float().abs().repeat_interleave(32, dim=1) * 2**-10 + 1e-6).all()
    assert torch.equal(back[4, 32:64], torch.full((32,), 0.5))


def test_weights_that_came_from_q4_1_come_back_exactly():
    # The default model's weights are dequantized Q4_1: quantizing them again must lose nothing.
    torch.manual_seed(1)
    q = torch.randint(0, 16, (8, 4, 32))
    q[..., 0], q[..., 1] = 0, 15  # the group's extremes are present, as in real Q4_1 blocks
    d = (torch.rand(8, 4) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(8, 4) * 0.1).half().float()
    w = (q.float() * d[..., None] + m[..., None]).reshape(8, 128)
    assert torch.equal(int4.dequantize(*int4.quantize_weight(w)), w)


def test_nibble_order_is_llama_cpp_q4_1s():
    # byte j of a group holds element j in its low nibble and element j + 16 in its high nibble
    first, second = list(range(16)), [15 - j for j in range(16)]
    w = torch.tensor([first + second], dtype=torch.float32)  # minimum 0, scale 1: q == the value
    nibbles, scale, minimum = int4.quantize_weight(w)
    assert scale.item() == 1 and minimum.item() == 0
    assert nibbles[0, 0].tolist() == [a | (b << 4) for a, b in zip(first, second, strict=True)]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33])
@pytest.mark.parametrize("in_features", [32, 96, 576])
def test_kernel_and_dequantize_paths_compute_the_dequantized_linear(kernel, rows, in_features, monkeypatch):
    torch.manual_seed(rows * 1000 + in_features)
    linear = nn.Linear(in_features, 130, bias=True)
    layer = int4.Int4Linear(linear, kernel)
    x = torch.randn(2, rows, in_features)
    want = torch.nn.functional.linear(x, layer.dequantized(), linear.bias)
    with torch.inference_mode():
        monkeypatch.setattr(int4, "KERNEL_MAX_ROWS", 10**6)
        torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)
        monkeypatch.setattr(int4, "KERNEL_MAX_ROWS", 0)
        torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)


def test_the_kernel_refuses_what_it_cannot_read(kernel):
    nibbles, scale, minimum = int4.quantize_weight(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.int4_linear(torch.randn(2, 48), nibbles, scale, minimum)
    with pytest.raises(RuntimeError, match="int4_linear"):
        kernel.int4_linear(torch.randn(2, 64).double(), nibbles, scale, minimum)
    with pytest.raises(RuntimeError, match="float16"):
        kernel.int4_linear(torch.randn(2, 64), nibbles, scale.float(), minimum)
    with pytest.raises(ValueError, match="divisible by 32"):
        int4.quantize_weight(torch.randn(4, 40))


def test_a_linear_whose_input_is_not_a_multiple_of_32_stays_float32():
    model = nn.Sequential(nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 8))
    assert int4.quantize_linears(model) == 1
    assert type(model[0]) is nn.Linear and isinstance(model[2], int4.Int4Linear)
    assert "2.weight" not in model.state_dict()  # the fp32 weight is gone, not kept beside the int4 one


def _dequantized_twin(model: nn.Module) -> nn.Module:
    """A copy of `model` whose linear weights are what int4 quantization will make of them (the head: int8)."""
    twin = copy.deepcopy(model)
    head = twin.get_output_embeddings()
    for module in twin.modules():
        if type(module) is nn.Linear:
            if module is head:
                weight = int8_dequantize(*int8_weight(module.weight))
            else:
                weight = int4.dequantize(*int4.quantize_weight(module.weight))
            module.weight = nn.Parameter(weight, requires_grad=False)
    return twin


@pytest.mark.parametrize("budget", [64, 8])  # 8: chunked prefill, decode batches under and over the kernel's limit
def test_int4_engine_matches_transformers_on_the_dequantized_weights(kernel, budget, monkeypatch):
    if budget == 8:
        monkeypatch.setattr(int4, "KERNEL_MAX_ROWS", 4)
    reference, ours = build_pair("llama")
    reference = _dequantized_twin(reference)
    cfg = SluiceConfig()
    cfg.model.quantization = "int4"
    cfg.cache.num_kv_blocks = 64
    cfg.scheduler.max_num_batched_tokens = budget
    cfg.scheduler.max_num_seqs = 16
    engine = LLMEngine(cfg, model=ours, tokenizer=_tiny.tokenizer())
    assert engine.dtype == torch.float32
    assert isinstance(engine.model.lm_head, Int8Linear)
    assert all(type(m) is int4.Int4Linear for m in engine.model.model.modules() if hasattr(m, "in_features"))
    prompts = mixed_prompts(12)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    got = [c.token_ids for c in engine.generate(prompts, params)]
    want = [hf_greedy(reference, p, MAX_NEW) for p in prompts]
    assert got == want


def test_int4_refuses_bfloat16():
    _, ours = build_pair("llama")
    cfg = SluiceConfig()
    cfg.model.quantization, cfg.model.dtype = "int4", "bfloat16"
    with pytest.raises(ValueError, match="int4 runs on CPU with float32"):
        LLMEngine(cfg, model=ours, tokenizer=_tiny.tokenizer())
