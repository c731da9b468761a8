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
from sluice import native
from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.config import SluiceConfig
from sluice.service.engine.engine import LLMEngine
from sluice.service.executor.layers.half_linear import HalfEmbedding, HalfFormat, HalfLinear, pack_half, unpack_half
from tests.support import tiny
from tests.support.int8_rounding import greedy_gaps
from tests.support.kernels import MARCHES, build_variant, variant_isas
from tests.support.parity import MAX_NEW, build_pair, mixed_prompts

HALVES = [torch.float16, torch.bfloat16]


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double().mm(w.double().T).float()


def test_blocks_hold_every_weight_once_and_give_it_back():
    w = torch.randn(130, 70).half()
    packed = pack_half(w)
    assert packed.shape == (3, 70, 64) and packed[2, :, 2:].eq(0).all()  # 130 = 2 x 64 + 2, the rest zero
    assert torch.equal(packed[1, 5, 7], w[64 + 7, 5])
    assert torch.equal(unpack_half(packed, 130), w)


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16])
# 70 and 7: inputs not a multiple of a vector; 130 and 64 outputs: a last block of two columns, and one whole block
@pytest.mark.parametrize(("out_features", "in_features"), [(130, 32), (130, 576), (64, 70), (130, 7), (576, 64),
                                                          (100, 16)])
def test_the_gemv_widens_16_bit_weights_exactly(kernel, half, rows, out_features, in_features):
    torch.manual_seed(rows * 100 + in_features)
    x, w = torch.randn(rows, in_features), torch.randn(out_features, in_features).to(half)
    got = kernel.packed_linear_half(x, pack_half(w), out_features)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(x, w), rtol=1e-5, atol=1e-4)


def _packed_linear_half(isa: str):
    """packed_linear.cpp built for `isa` (a key of MARCHES) as a torch op."""
    binding = ('#include <torch/library.h>\n#include "cpu_ops.h"\n'
               f'TORCH_LIBRARY(sluice_test_half_{isa}, m) {{ m.def("packed_linear_half", &packed_linear_half); }}\n')
    build_variant(f"half_{isa}", ["packed_linear.cpp"], binding, ["-O3", MARCHES[isa], *native.OPENMP_FLAGS],
                  python_module=False)
    return getattr(torch.ops, f"sluice_test_half_{isa}").packed_linear_half


@pytest.mark.deep  # slow (builds or a long end-to-end run): `make test-deep`
@pytest.mark.parametrize("half", HALVES)
def test_every_instruction_set_widens_the_same_weights(half):
    # The portable loop converts one element at a time (c10's conversions), AVX2 eight (F16C, a shift for bf16).
    torch.manual_seed(0)
    x, w = torch.randn(5, 70), torch.randn(130, 70).to(half)
    w[0, :4] = torch.tensor([65504.0, -0.0, 6e-8, float("inf")]).to(half)  # largest, signed zero, subnormal, inf
    for isa in variant_isas():
        for rows, n in ((1, 40), (5, 40), (1, 130), (1, 25)):  # one row: whole blocks and halves split between threads
            got = _packed_linear_half(isa)(x[:rows], pack_half(w[:n]), n)
            torch.testing.assert_close(got, _reference(x[:rows], w[:n]), rtol=1e-5, atol=1e-4, msg=isa)


def test_the_gemv_refuses_what_it_cannot_read(kernel):
    packed = pack_half(torch.randn(4, 8).half())
    with pytest.raises(RuntimeError, match="packed_linear_half"):
        kernel.packed_linear_half(torch.randn(2, 8).half(), packed, 4)  # 16-bit activations
    with pytest.raises(RuntimeError, match="packed_linear_half"):
        kernel.packed_linear_half(torch.randn(2, 8), packed, 65)  # more outputs than its blocks hold
    with pytest.raises(RuntimeError, match="16-bit"):
        kernel.LayerLinear(packed.float(), 4, None)  # a float32 weight is not a 16-bit one


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("rows", [1, 7, 33, 130])
def test_a_linear_keeps_16_bits_and_computes_in_float32_at_any_row_count(kernel, half, rows):
    torch.manual_seed(rows)
    w, bias = torch.randn(100, 64), torch.randn(100)
    x = torch.randn(rows, 64)
    want = _reference(x, w.to(half)) + bias
    for ops in (kernel, None):  # the packed kernel, or torch on the widened weight where no compiler built it
        linear = HalfLinear(w, bias, half, ops)
        assert linear.packed.dtype == half and linear.bias.dtype == torch.float32
        assert (linear.kernel_facts().op is None) == (ops is None)
        torch.testing.assert_close(linear(x), want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(linear.dense_weight(), w.to(half).float())


def test_the_embedding_and_a_tied_head_share_one_16_bit_table(kernel):
    table = torch.randn(50, 64)
    formats = HalfFormat("f16", kernel)
    embed = formats.embedding(table, torch.device("cpu"), torch.float32)
    head = formats.tied_head(embed)
    assert isinstance(embed, HalfEmbedding) and embed.table.packed.dtype == torch.float16
    assert head is embed.table  # one copy of the bytes
    ids = torch.tensor([[3, 0, 49]])
    assert embed(ids).dtype == torch.float32 and embed(ids).shape == (1, 3, 64)
    torch.testing.assert_close(embed(ids), table.half().float()[ids])
    with pytest.raises(IndexError):
        embed(torch.tensor([50]))
    fused = formats.make_parts([torch.randn(8, 64), torch.randn(4, 64)], [None, None], ["q", "k"],
                               torch.device("cpu"), torch.float32)
    assert fused.packed.dtype == torch.float16 and fused.out_features == 12
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
    assert linears and all(m.packed.dtype == half for m in linears)
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


def _write_half_gguf(path, config) -> dict[str, torch.Tensor]:
    """A tiny Qwen2 GGUF whose linears are F16 or BF16 (q and k of one linear in different types), the embedding
    F16 and tied to the head, the norms F32; returns the float values it stores under transformers' names."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "qwen2")
    floats: dict[str, torch.Tensor] = {}
    rng = np.random.default_rng(0)

    def add(hf: str, name: str, shape: tuple[int, ...], kind: str) -> None:
        x = torch.from_numpy((0.2 * rng.standard_normal(shape)).astype(np.float32))
        if kind == "F32":  # a norm
            floats[hf] = 1 + x
            writer.add_tensor(name, floats[hf].numpy())
        elif kind == "F16":
            floats[hf] = x.half().float()
            writer.add_tensor(name, x.half().numpy())
        else:  # BF16: its bytes, as llama.cpp's converter writes them
            floats[hf] = x.bfloat16().float()
            writer.add_tensor(name, x.bfloat16().view(torch.uint8).numpy(), raw_dtype=gguf.GGMLQuantizationType.BF16)

    h, inner, kv = config.hidden_size, config.intermediate_size, config.hidden_size // 2
    add("model.embed_tokens.weight", "token_embd.weight", (config.vocab_size, h), "F16")
    for i in range(config.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, name, shape, kind in (("self_attn.q_proj", "attn_q", (h, h), "F16"),
                                      ("self_attn.k_proj", "attn_k", (kv, h), "BF16"),
                                      ("self_attn.v_proj", "attn_v", (kv, h), "F16"),
                                      ("self_attn.o_proj", "attn_output", (h, h), "BF16"),
                                      ("mlp.gate_proj", "ffn_gate", (inner, h), "F16"),
                                      ("mlp.up_proj", "ffn_up", (inner, h), "F16"),
                                      ("mlp.down_proj", "ffn_down", (h, inner), "BF16")):
            add(f"{p}{hf}.weight", f"{b}{name}.weight", shape, kind)
        add(f"{p}input_layernorm.weight", f"{b}attn_norm.weight", (h,), "F32")
        add(f"{p}post_attention_layernorm.weight", f"{b}ffn_norm.weight", (h,), "F32")
    add("model.norm.weight", "output_norm.weight", (h,), "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return floats


def test_a_gguf_files_f16_and_bf16_tensors_are_served_as_stored(tmp_path, kernel):
    import transformers

    from sluice.service.executor.layers.gguf_linear import MergedLinear
    from sluice.service.executor.layers.linear import PlainFormat
    from sluice.service.executor.models import gguf_weights, weights

    tok = tiny.tokenizer()
    config = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=tok.eos_token_id, bos_token_id=None,
        tie_word_embeddings=True)
    floats = _write_half_gguf(tmp_path / "half.gguf", config)
    cpu = torch.device("cpu")
    ours = gguf_weights.load(tmp_path / "half.gguf", config, cpu, torch.float32)
    assert isinstance(ours.embed_tokens, HalfEmbedding) and ours.embed_tokens.table.packed.dtype == torch.float16
    assert ours.lm_head is ours.embed_tokens.table  # one copy of the table
    layer = ours.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, MergedLinear)  # F16 q and v, BF16 k: side by side
    assert layer.mlp.gate_up_proj.packed.dtype == torch.float16 and layer.mlp.down_proj.packed.dtype == torch.bfloat16
    assert all(x._layer_ops is not None for x in ours.layers)  # decode steps on the fused layer
    reference = weights.build(config, floats.get, PlainFormat(cpu, torch.float32), cpu, torch.float32)
    prompts = mixed_prompts(6)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def greedy(model):
        return [c.token_ids for c in half_engine(model, "none", budget=32, dtype="float32").generate(prompts, params)]

    assert greedy(ours) == greedy(reference)  # float32 arithmetic on the same values

