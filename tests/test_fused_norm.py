"""Fused RMSNorm: the C++ op against transformers' own layers, and which layers get swapped."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from sluice.service.engine.fused_norm import FusedRMSNorm, fuse_rms_norms
from tests.test_parity import build_pair


@pytest.mark.parametrize("cls", [LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm])
@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 7, 64), (3, 5, 70), (1, 200, 576)])  # 70: a tail; 200: threads
def test_fused_norm_equals_transformers_layer(kernel, cls, shape):
    torch.manual_seed(sum(shape))
    norm = cls(shape[-1], eps=0.25)  # large enough that a dropped or misplaced eps shows
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(shape)
    fused = FusedRMSNorm(norm)
    with torch.inference_mode():
        torch.testing.assert_close(fused(x), norm(x), rtol=1e-5, atol=1e-6)
        y = x.half()  # neither float32 nor bf16: the eager formula, exactly transformers'
        assert torch.equal(fused(y), norm(y))


@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 5, 70), (1, 600, 576)])
def test_fused_bf16_norm_rounds_where_transformers_does(kernel, shape):
    torch.manual_seed(sum(shape))
    norm = LlamaRMSNorm(shape[-1], eps=0.25).bfloat16()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(shape).bfloat16()
    with torch.inference_mode():
        got, want = FusedRMSNorm(norm)(x), norm(x)
    assert got.dtype == torch.bfloat16
    # the same two bf16 roundings; the float32 sum of squares may differ in its last bits and flip a rounding
    assert (got.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
    assert (got != want).float().mean() < 0.01


def test_swaps_every_llama_norm_but_not_gemmas(kernel):
    _, model = build_pair("llama")
    layers = model.config.num_hidden_layers
    assert fuse_rms_norms(model) == 2 * layers + 1
    assert isinstance(model.model.norm, FusedRMSNorm)
    assert fuse_rms_norms(model) == 0  # idempotent
    assert "model.norm.weight" in model.state_dict()  # the weights stay where checkpoints expect them
    copy.deepcopy(model)  # benches copy engine models
    gemma = torch.nn.Sequential(GemmaRMSNorm(64))  # 1 + weight: a different formula
    assert fuse_rms_norms(gemma) == 0
