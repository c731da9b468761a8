"""Sluice's own Llama-family model: its layers against transformers' (rotary, RMSNorm, MLP), its forward against
transformers' own forward (token ids and logprobs), weights loaded straight from safetensors, which architectures
it takes, and the quantized layers' C++ path against the Python one. Greedy outputs through the engine are checked
against transformers' generate in test_parity."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from sluice import native
from sluice.kvcache.kv_tensors import KVTensors
from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.attention.paged_attention import AttentionMetadata
from sluice.service.config import ModelConfig, SluiceConfig
from sluice.service.engine.engine import LLMEngine
from sluice.service.executor.forward_context import ForwardContext, set_forward_context
from sluice.service.executor.layers.linear import PlainFormat
from sluice.service.executor.layers.mlp import GatedMLP
from sluice.service.executor.layers.norm import RMSNorm
from sluice.service.executor.layers.rotary import apply_rotary
from sluice.service.executor.models import weights
from sluice.service.executor.models.llama import LlamaForCausalLM
from sluice.service.executor.weight_prep import prepare_weights
from tests.support import tiny
from tests.support.parity import build_pair, mixed_prompts

CPU = torch.device("cpu")


def rotary_case(dtype: torch.dtype, tokens: int, heads: int = 9, kv_heads: int = 3, head_dim: int = 64):
    """q and k as strided [T, H, D] views of one projection buffer (as the fused qkv gives), cos and sin [T, D]."""
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
    monkeypatch.setattr(native, "load", lambda: None)
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


@pytest.mark.parametrize("cls", [LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm])
@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (15, 70), (200, 576)])  # 70: a tail; 200: threads
def test_rms_norm_equals_transformers_layer(kernel, cls, shape):
    torch.manual_seed(sum(shape))
    theirs = cls(shape[-1], eps=0.25)  # large enough that a dropped or misplaced eps shows
    with torch.no_grad():
        theirs.weight.normal_()
    x = torch.randn(shape)
    ours = RMSNorm(theirs.weight.detach().clone(), 0.25)
    with torch.inference_mode():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)
        y = x.half()  # neither float32 nor bf16: the eager formula, exactly transformers'
        assert torch.equal(RMSNorm(theirs.weight.detach().half(), 0.25)(y), theirs.half()(y))


@pytest.mark.parametrize("shape", [(1, 576), (15, 70), (600, 576)])
def test_bf16_rms_norm_rounds_where_transformers_does(kernel, shape):
    torch.manual_seed(sum(shape))
    theirs = LlamaRMSNorm(shape[-1], eps=0.25).bfloat16()
    with torch.no_grad():
        theirs.weight.normal_()
    x = torch.randn(shape).bfloat16()
    with torch.inference_mode():
        got, want = RMSNorm(theirs.weight.detach().clone(), 0.25)(x), theirs(x)
    assert got.dtype == torch.bfloat16
    # the same two bf16 roundings; the float32 sum of squares may differ in its last bits and flip a rounding
    assert (got.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
    assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_mlp_on_fused_gate_up_is_transformers_bit_for_bit(dtype):
    _, llama = build_pair("llama")
    mlp: LlamaMLP = llama.model.layers[0].mlp.to(dtype)
    gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
    ours = GatedMLP(torch.nn.Linear(64, 256, bias=False, dtype=dtype), copy.deepcopy(mlp.down_proj))
    ours.gate_up_proj.weight.data.copy_(gate_up)
    x = torch.randn(5, llama.config.hidden_size).to(dtype)
    with torch.inference_mode():
        assert torch.equal(ours(x), mlp(x))


def forward_both(arch: str, prompt: list[int]):
    """Logits of transformers' own forward and of the owned model on pure-torch linears (no padding, no GEMV: the
    arithmetic transformers runs) over one prompt on a paged cache."""
    reference, source = build_pair(arch)
    ours = weights.from_transformers(source, PlainFormat(torch.device("cuda"), torch.float32), CPU, torch.float32)
    ids = torch.tensor(prompt)
    config = ours.config
    kv = KVTensors(4, config.num_hidden_layers, config.num_key_value_heads, weights.attention_shape(config)[2], 16,
                   torch.float32, CPU)
    positions = torch.arange(len(prompt))
    meta = AttentionMetadata.build([len(prompt)], [len(prompt)], torch.arange(4, dtype=torch.int32)[None],
                                   positions.clone(), 16)
    with torch.inference_mode(), set_forward_context(ForwardContext(meta, kv.layers)):
        got = ours.compute_logits(ids, positions, positions)
        want = reference(ids[None]).logits[0]
    return got, want


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_owned_fp32_forward_is_transformers_forward_bit_for_bit_in_pure_torch(arch, monkeypatch):
    monkeypatch.setattr(native, "load", lambda: None)  # the path CUDA and machines without a compiler take
    got, want = forward_both(arch, mixed_prompts(1)[0][:40])
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_owned_fp32_forward_with_the_cpp_ops_gives_transformers_token_ids_and_logprobs(kernel, arch):
    # the C++ RMSNorm sums squares in another order: the last bits of a logit may differ, nothing more
    got, want = forward_both(arch, mixed_prompts(1)[0][:40])
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(got.log_softmax(-1), want.log_softmax(-1), rtol=0, atol=2e-5)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_supported_architectures_never_fall_back_to_transformers(arch):
    _, model = build_pair(arch)
    assert weights.unsupported_reason(model.config) is None
    owned = prepare_weights(model, ModelConfig(), CPU, torch.float32)
    assert isinstance(owned, LlamaForCausalLM)
    assert not any(type(m).__module__.startswith("transformers") for m in owned.modules())


def test_other_architectures_and_the_switch_run_transformers_model(caplog):
    caplog.set_level("INFO", logger="sluice.engine")
    gemma = transformers.GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    assert "gemma" in weights.unsupported_reason(gemma)
    model = transformers.AutoModelForCausalLM.from_config(gemma)
    assert prepare_weights(model, ModelConfig(), CPU, torch.float32) is model
    with pytest.raises(ValueError, match="needs Sluice's own forward"):
        prepare_weights(model, ModelConfig(quantization="int8"), CPU, torch.float32)
    _, llama = build_pair("llama")
    assert prepare_weights(llama, ModelConfig(owned_model=False), CPU, torch.float32) is llama
    assert "model path: transformers' LlamaForCausalLM" in caplog.text and "--no-owned-model" in caplog.text


def test_weights_load_straight_from_safetensors(tmp_path, monkeypatch):
    path = tiny.save_tiny_model(str(tmp_path / "tiny"))  # a tied head, as SmolLM2's
    reference = transformers.AutoModelForCausalLM.from_pretrained(path)

    def no_modeling(*args, **kwargs):
        raise AssertionError("a transformers modeling module was built")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_modeling)
    monkeypatch.setattr(transformers.LlamaForCausalLM, "__init__", no_modeling)
    from sluice.service.executor.model_loader import load_model

    model, _ = load_model(path, "cpu", "float32", settings=ModelConfig(prepack_weights=False))
    assert isinstance(model, LlamaForCausalLM) and model.generation_config.eos_token_id == 2
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()  # tied: one copy
    from sluice.service.bench.ceiling import checkpoint_state

    state = checkpoint_state(model)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_the_checkpoint_is_mapped_a_tensor_at_a_time_and_unmapped_once_loaded(tmp_path):
    """Each tensor's mapping lives as long as the tensor: the file's pages leave the resident set as the load
    converts them, and none stay mapped after it."""
    path = tiny.save_tiny_model(str(tmp_path / "tiny"))
    checkpoint = str(next(Path(path).glob("*.safetensors")).resolve())
    tensors = weights.safetensors_tensors(Path(path))
    view = tensors("model.embed_tokens.weight")
    assert checkpoint in Path("/proc/self/maps").read_text() and tensors("lm_head.weight") is None
    del view
    assert checkpoint not in Path("/proc/self/maps").read_text()
    from sluice.service.executor.model_loader import load_model

    for quantization in ("none", "int4"):
        model, _ = load_model(path, "cpu", "float32", settings=ModelConfig(quantization=quantization))
        assert isinstance(model, LlamaForCausalLM) and checkpoint not in Path("/proc/self/maps").read_text()


def twin_engines(quantization: str, dtype: str = "float32", arch: str = "llama") -> list[LLMEngine]:
    """Two engines on copies of one tiny model of `arch`, chunked prefill mixing prefills and decodes in steps."""
    _, model = build_pair(arch)
    torch.manual_seed(7)
    with torch.no_grad():  # transformers starts biases at 0 and norms at 1: values that would hide a missing term
        for name, param in model.named_parameters():
            if name.endswith("bias") or "q_norm" in name or "k_norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    engines = []
    for _ in range(2):
        cfg = SluiceConfig()
        cfg.model.dtype, cfg.model.quantization = dtype, quantization
        cfg.cache.num_kv_blocks, cfg.scheduler.max_num_batched_tokens = 64, 24
        engines.append(LLMEngine(cfg, model=copy.deepcopy(model), tokenizer=tiny.tokenizer()))
    return engines


# qwen2: q/k/v biases; qwen3: per-head q/k norms (each in one format: the formats share the layer object's code)
@pytest.mark.parametrize("quantization, arch", [("int4", "llama"), ("int8", "llama"), ("int4", "qwen2"),
                                                ("int8", "qwen3")])
def test_quantized_layers_run_in_cpp_around_the_attention_bit_for_bit(kernel, quantization, arch):
    # csrc/llama_layer.cpp runs a quantized layer's norms, projections, rotary and MLP in two calls; it must give
    # the Python path's results exactly: the second engine runs without the C++ object.
    assert_cpp_layers_match_python(twin_engines(quantization, arch=arch))


def assert_cpp_layers_match_python(engines: list[LLMEngine]) -> None:
    """The first engine runs its layers' C++ objects, the second the Python path: same tokens, same logprobs."""
    cpp, python = (engine.model.layers for engine in engines)
    assert all(layer._layer_ops is not None for layer in cpp)
    for layer in python:
        layer._layer_ops = None
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    got, want = (engine.generate(mixed_prompts(8), params) for engine in engines)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]


@pytest.mark.parametrize("dtype, arch", [("float32", "llama"), ("bfloat16", "llama"), ("bfloat16", "qwen2"),
                                         ("float32", "qwen3")])
def test_prepacked_float_layers_run_in_cpp_around_the_attention_bit_for_bit(kernel, dtype, arch):
    # Float weights packed for oneDNN's GEMV take the same C++ layer object at decode sizes: same tokens, same
    # logprobs as the Python path.
    from sluice.service.executor.layers.packed_linear import PackedLinear

    engines = twin_engines("none", dtype, arch)
    linears = [m for m in engines[0].model.layers.modules() if isinstance(m, PackedLinear)]
    if not linears or not all(m.method.gemv_layout for m in linears):
        pytest.skip(f"no prepacked {dtype} GEMV layout on this CPU")
    assert_cpp_layers_match_python(engines)


def test_layers_with_plain_float_linears_keep_the_python_path():
    _, model = build_pair("llama")
    owned = prepare_weights(model, ModelConfig(prepack_weights=False), CPU, torch.float32)
    assert all(layer._layer_ops is None for layer in owned.layers)



def test_a_copied_layer_builds_its_own_cpp_object():
    """The C++ object points into its linears' packed weights: a deep copy (which repacks) must not share it."""
    packed = prepare_weights(build_pair("llama")[1], ModelConfig(), CPU, torch.float32)
    if packed.layers[0]._layer_ops is None:
        pytest.skip("no prepacked float32 GEMV layout on this CPU")
    copied = copy.deepcopy(packed)
    for old, new in zip(packed.layers, copied.layers, strict=True):
        assert new._layer_ops is not None and new._layer_ops is not old._layer_ops
        assert new.mlp.down_proj.method.packed_ptr != old.mlp.down_proj.method.packed_ptr


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # tiny configs are untied; Qwen3 has q/k norms
def test_the_build_fetches_each_tensor_once(arch):
    """A fetch reads the checkpoint (and reorders a GGUF file's q/k rows): whether an optional tensor exists (q/k
    norms, an untied head, biases) is read off its one fetch."""
    _, source = build_pair(arch)
    state, fetched = source.state_dict(), []

    def tensors(name: str):
        fetched.append(name) if name in state else None
        return state.get(name)

    model = weights.build(source.config, tensors, PlainFormat(CPU, torch.float32), CPU, torch.float32)
    assert sorted(fetched) == sorted(state) and model.lm_head is not model.embed_tokens
