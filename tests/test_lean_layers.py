"""Lean Llama layers: the C++ rotary against transformers' own, the lean MLP and decoder layer against theirs, and
which modules are swapped. The engine's greedy outputs on the swapped layers are checked against transformers'
generate in test_parity."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, apply_rotary_pos_emb

from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.config import SluiceConfig
from sluice.service.engine import cpu_ops
from sluice.service.engine.engine import LLMEngine
from sluice.service.engine.lean_layers import (
    LeanLlamaDecoderLayer,
    LeanLlamaMLP,
    PagedLlamaAttention,
    apply_rotary,
    lean_causal_lm_forward,
    lean_llama_layers,
)
from tests import _tiny
from tests.test_parity import build_pair, mixed_prompts


def rotary_case(dtype: torch.dtype, tokens: int, heads: int = 9, kv_heads: int = 3, head_dim: int = 64):
    """q and k as strided [T, H, D] views of one projection buffer (as a fused qkv would give), cos and sin [T, D]."""
    torch.manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    angles = torch.arange(tokens, dtype=torch.float32)[:, None] * (1e4 ** -torch.linspace(0, 1, head_dim // 2))
    angles = torch.cat((angles, angles), dim=-1)
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


def transformers_rotary(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb on the [1, H, T, D] layout its attention uses, back as [T, H, D]."""
    rq, rk = apply_rotary_pos_emb(q[None].transpose(1, 2), k[None].transpose(1, 2), cos[None], sin[None])
    return rq[0].transpose(0, 1), rk[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 300])  # 300: more than one thread's share
def test_rotary_op_is_transformers_bit_for_bit(kernel, dtype, tokens):
    q, k, cos, sin = rotary_case(dtype, tokens)
    want_q, want_k = transformers_rotary(q, k, cos, sin)
    kernel.rotary_embedding_(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_without_the_op_is_transformers_too(monkeypatch, dtype):
    monkeypatch.setattr(cpu_ops, "load", lambda: None)
    q, k, cos, sin = rotary_case(dtype, 5)
    want_q, want_k = transformers_rotary(q, k, cos, sin)
    apply_rotary(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_rotary_op_rejects_what_it_cannot_read(kernel):
    q, k, cos, sin = rotary_case(torch.float32, 3)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel.rotary_embedding_(q, k, cos.double(), sin)
    with pytest.raises(RuntimeError, match="head dim must be contiguous"):
        kernel.rotary_embedding_(q[..., ::2], k[..., ::2], cos[:, :32], sin[:, :32])
    with pytest.raises(RuntimeError, match="one cos/sin row per token"):
        kernel.rotary_embedding_(q, k, cos[:2], sin[:2])


class ShiftedAttention(LlamaAttention):
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        return super().forward(hidden_states + 1, position_embeddings, attention_mask, **kwargs)


def test_swaps_llama_layers_but_not_a_changed_forward_or_other_families():
    _, llama = build_pair("llama")
    layers = llama.config.num_hidden_layers
    assert lean_llama_layers(llama) == {"attention": layers, "mlp": layers, "decoder layer": layers}
    assert all(isinstance(layer, LeanLlamaDecoderLayer) and isinstance(layer.self_attn, PagedLlamaAttention)
               and isinstance(layer.mlp, LeanLlamaMLP) for layer in llama.model.layers)
    assert set(lean_llama_layers(llama).values()) == {0}  # idempotent
    assert "model.layers.0.self_attn.q_proj.weight" in llama.state_dict()  # weights where checkpoints have them
    _, qwen3 = build_pair("qwen3")  # q and k norms: an attention of its own; its MLP is Llama's
    assert lean_llama_layers(qwen3) == {"attention": 0, "mlp": layers, "decoder layer": 0}
    shifted = nn.Sequential(ShiftedAttention(llama.config, 0))
    assert lean_llama_layers(shifted)["attention"] == 0
    gelu = LlamaMLP(type(llama.config)(**{**llama.config.to_dict(), "hidden_act": "gelu"}))
    assert lean_llama_layers(nn.Sequential(gelu))["mlp"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_mlp_is_transformers_bit_for_bit(dtype):
    _, llama = build_pair("llama")
    mlp = llama.model.layers[0].mlp.to(dtype)
    x = torch.randn(1, 5, llama.config.hidden_size).to(dtype)
    with torch.inference_mode():
        assert torch.equal(LeanLlamaMLP(mlp)(x), mlp(x))


def test_a_copy_put_back_on_sdpa_runs_transformers_forwards():
    """The bench's raw-forward ceiling times a copy of the engine's model on sdpa with a DynamicCache."""
    reference, ours = build_pair("llama")
    lean_llama_layers(ours)
    ours.set_attn_implementation("sdpa")
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    with torch.inference_mode():
        assert torch.equal(ours(ids).logits, reference(ids).logits)
        want = reference.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0), want)


def test_no_lean_layers_keeps_transformers_forwards():
    from sluice.service.config import SluiceConfig
    from sluice.service.engine.engine import LLMEngine
    from tests import _tiny

    _, ours = build_pair("llama")
    cfg = SluiceConfig()
    cfg.model.device, cfg.model.dtype, cfg.model.lean_layers = "cpu", "float32", False
    cfg.cache.num_kv_blocks = 16
    engine = LLMEngine(cfg, model=ours, tokenizer=_tiny.tokenizer())
    assert type(engine.model.model.layers[0]).__name__ == "LlamaDecoderLayer"
    assert type(engine.model.model.layers[0].self_attn).__name__ == "LlamaAttention"


def twin_engines(quantization: str) -> list[LLMEngine]:
    """Two float32 engines on copies of one tiny Llama, chunked prefill mixing prefills and decodes in steps."""
    _, model = build_pair("llama")
    engines = []
    for _ in range(2):
        cfg = SluiceConfig()
        cfg.model.dtype, cfg.model.quantization = "float32", quantization
        cfg.cache.num_kv_blocks, cfg.scheduler.max_num_batched_tokens = 64, 24
        engines.append(LLMEngine(cfg, model=copy.deepcopy(model), tokenizer=_tiny.tokenizer()))
    return engines


def assert_same_outputs(engines: list[LLMEngine]) -> None:
    """Both engines give the same greedy token ids and logprobs, exactly."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    got, want = (engine.generate(mixed_prompts(8), params) for engine in engines)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_quantized_layers_run_in_cpp_around_the_attention_bit_for_bit(kernel, quantization):
    # csrc/llama_layer.cpp runs a quantized layer's norms, projections, rotary and MLP in two calls; it must give
    # the Python path's results exactly: the second engine runs without the C++ object.
    engines = twin_engines(quantization)
    cpp, python = (engine.model.model.layers for engine in engines)
    assert all(layer._layer_ops is not None for layer in cpp)
    for layer in python:
        layer._layer_ops = None
    assert_same_outputs(engines)


def test_the_runner_skips_transformers_wrappers_around_a_lean_llama_bit_for_bit():
    engines = twin_engines("none")
    assert engines[0].runner._lean_forward is not None
    engines[1].runner._lean_forward = None  # the model's own forward
    assert_same_outputs(engines)


def test_only_a_llama_on_lean_layers_gets_the_lean_forward():
    _, model = build_pair("llama")
    assert lean_causal_lm_forward(model) is None  # transformers' own layers
    lean_llama_layers(model)
    assert lean_causal_lm_forward(model) is not None
    _, qwen = build_pair("qwen2")
    lean_llama_layers(qwen)  # its attention keeps its own forward, so its decoder layers stay transformers'
    assert lean_causal_lm_forward(qwen) is None


def test_layers_with_float_linears_keep_the_python_path():
    _, model = build_pair("llama")
    lean_llama_layers(model)
    assert all(layer._layer_ops is None for layer in model.model.layers)
