"""--quantization int4 (GGUF Q4_1 blocks, packed 16 rows together for the kernel): quantization, the kernel against
plain torch, and the int4 engine against transformers on the same dequantized weights (only the weights' precision
changes, so the oracle stays exact)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.config import SluiceConfig
from sluice.service.engine.engine import LLMEngine
from sluice.service.executor.layers.gguf_blocks import GgufBlocks, quantize
from sluice.service.executor.layers.gguf_linear import GgufEmbedding, GgufLinear, QuantizeFormat
from sluice.service.executor.layers.gguf_packs import pack_q4_1, unpack_q4_1
from sluice.service.executor.layers.linear import PlainLinear
from sluice.service.executor.layers.quant_types import dequantize
from tests.support import tiny
from tests.support.int8_rounding import RoundedActivations, greedy_gaps
from tests.support.kernels import integer_kernels, variant_isas
from tests.support.parity import MAX_NEW, build_pair, mixed_prompts


def split(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 rows uint8 [N, G * 20] → nibbles uint8 [N, G, 16], scale and minimum float16 [N, G]."""
    b = blocks.reshape(blocks.shape[0], -1, 20)
    return b[..., 4:], b[..., 0:2].contiguous().view(torch.float16)[..., 0], \
        b[..., 2:4].contiguous().view(torch.float16)[..., 0]


def q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Q4_1 blocks of `weight`, split."""
    return split(quantize(weight, "Q4_1"))


def int4_linear(weight: torch.Tensor, bias: torch.Tensor | None, kernel) -> GgufLinear:
    return GgufLinear(GgufBlocks(quantize(weight, "Q4_1"), "Q4_1", weight.shape[1]), bias, kernel)



@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_quantizing_a_few_rows_at_a_time_is_quantizing_them_all_at_once(monkeypatch, qtype):
    from sluice.service.executor.layers import gguf_blocks

    weight = torch.randn(300, 64) * torch.linspace(0.01, 3, 300)[:, None]
    whole = quantize(weight, qtype)
    monkeypatch.setattr(gguf_blocks, "QUANTIZE_CHUNK_BYTES", 7 * 64 * 4)  # 7 rows at a time, the last chunk short
    assert torch.equal(quantize(weight, qtype), whole) and whole.shape == (300, 2 * (20 if qtype == "Q4_1" else 34))
    with pytest.raises(ValueError, match="no quantization"):
        quantize(weight, "Q5_0")

def test_quantize_rounds_to_within_half_a_step_of_the_stored_scale_and_minimum():
    torch.manual_seed(0)
    w = torch.randn(9, 96) * torch.linspace(0.01, 3, 9)[:, None]
    w[4, 32:64] = 0.5  # a constant group: zero range, every element must come back exactly
    nibbles, scale, minimum = q4_1(w)
    assert nibbles.dtype == torch.uint8 and nibbles.shape == (9, 3, 16)
    assert scale.dtype == minimum.dtype == torch.float16 and scale.shape == (9, 3)
    back = dequantize(quantize(w, "Q4_1"), "Q4_1", 96)
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
    assert torch.equal(dequantize(quantize(w, "Q4_1"), "Q4_1", 128), w)


def test_nibble_order_is_llama_cpp_q4_1s():
    # byte j of a group holds element j in its low nibble and element j + 16 in its high nibble
    first, second = list(range(16)), [15 - j for j in range(16)]
    w = torch.tensor([first + second], dtype=torch.float32)  # minimum 0, scale 1: q == the value
    nibbles, scale, minimum = q4_1(w)
    assert scale.item() == 1 and minimum.item() == 0
    assert nibbles[0, 0].tolist() == [a | (b << 4) for a, b in zip(first, second, strict=True)]


def w4a8_reference(x: torch.Tensor, nibbles, scale, minimum) -> torch.Tensor:
    """What the kernel computes, in plain torch: x [M, K] quantized to int8 per group of 32 (scale max|x| / 127,
    rounded half to even), exact integer dot products with the nibbles, then the float scales and the minimum's
    term on the float group sums. In float64, so only the kernel's float32 sums can differ."""
    m, k = x.shape
    groups = x.reshape(m, k // 32, 32)
    amax = groups.abs().amax(-1)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    qx = torch.round(groups * inv[..., None]).double()  # float32 product, as the kernel rounds it
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).double()  # [N, G, 32]
    dot = torch.einsum("mgj,ngj->mng", qx, q)
    d = scale.float()[None] * (amax / 127)[:, None, :]  # float32, as the kernel multiplies them
    y = (dot * d.double()).sum(-1) + (minimum.double()[None] * groups.sum(-1).double()[:, None, :]).sum(-1)
    return y.float()


def test_pack_is_a_permutation_of_the_q4_1_bytes_and_unpack_inverts_it():
    torch.manual_seed(3)
    blocks = quantize(torch.randn(40, 64), "Q4_1")  # 40 rows: the last block is padded
    nibbles, scale, minimum = split(blocks)
    packed, pscale, pminimum = pack_q4_1(blocks)
    assert packed.shape == (3, 2, 4, 16, 4) and pscale.shape == pminimum.shape == (3, 2, 16)
    # block 1, group 1, chunk 2, row 5 of the block: bytes 8..11 of row 21's group 1
    assert packed[1, 1, 2, 5].tolist() == nibbles[21, 1, 8:12].tolist()
    assert pscale[1, 1, 5] == scale[21, 1] and pminimum[1, 1, 5] == minimum[21, 1]
    assert (packed[2, :, :, 8:] == 0).all()  # padding rows
    assert torch.equal(unpack_q4_1(packed, pscale, pminimum, 40), blocks)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33])
@pytest.mark.parametrize("in_features", [32, 96, 576])
def test_kernel_computes_the_int8_activation_linear_and_stays_near_the_float_one(kernel, rows, in_features):
    torch.manual_seed(rows * 1000 + in_features)
    linear = nn.Linear(in_features, 130, bias=True)  # 130 outputs: a padded last block
    layer = int4_linear(linear.weight.detach(), linear.bias.detach(), kernel)
    assert layer.method.packed and {name for name, _ in layer.named_buffers()} == {"blocks", "scale", "minimum"}
    x = torch.randn(2, rows, in_features)
    x[0, 0, :32] = 0  # an all-zero group: scale 0
    exact = torch.nn.functional.linear(x, layer.dequantized(), linear.bias)
    want = w4a8_reference(x.reshape(-1, in_features), *q4_1(linear.weight.detach())).view_as(exact) + linear.bias
    with torch.inference_mode():
        layer.method.max_rows = 10**6
        got = layer(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (got - exact).norm() / exact.norm() < 0.05  # int8 activations: a few % off the float linear
        layer.method.max_rows = 0  # more rows than the kernel takes: dequantized tiles (unpacked) + GEMM
        layer.method.tile_rows = 32  # several tiles, not all on a 16-row boundary of the weight's 130 rows
        torch.testing.assert_close(layer(x), exact, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [7, 13])
def test_kernel_rows_past_one_pass_take_turns_on_tiles_of_the_weight(kernel, rows):
    # Past one pass's rows the passes walk tiles of ~128 KiB of blocks (28 blocks of 576 inputs): 1,000 outputs
    # split over the threads end tiles mid-range and leave short last tiles.
    torch.manual_seed(rows)
    weight = torch.randn(1000, 576) * 0.05
    layer, x = int4_linear(weight, None, kernel), torch.randn(rows, 576)
    with torch.inference_mode():
        layer.method.max_rows = 10**6
        torch.testing.assert_close(layer(x), w4a8_reference(x, *q4_1(weight)), rtol=1e-5, atol=1e-5)


def test_threads_that_split_a_row_of_groups_quantize_it_alike(kernel):
    # 61 rows of 18 groups: past the 1,024 groups one thread takes, two threads split the rows' groups mid-row
    # (549 each), and the last block of interleaved rows holds 5 where the others hold 8 (AVX-512) or 3 (AVX2).
    torch.manual_seed(61)
    weight = torch.randn(64, 576) * 0.05
    layer, x = int4_linear(weight, None, kernel), torch.randn(61, 576)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            layer.method.max_rows = 10**6
            torch.testing.assert_close(layer(x), w4a8_reference(x, *q4_1(weight)), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_the_kernel_refuses_what_it_cannot_read(kernel):
    packed, scale, minimum = pack_q4_1(quantize(torch.randn(16, 64), "Q4_1"))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.int4_linear(torch.randn(2, 48), packed, scale, minimum, 16)
    with pytest.raises(RuntimeError, match="int4_linear"):
        kernel.int4_linear(torch.randn(2, 64).double(), packed, scale, minimum, 16)
    with pytest.raises(RuntimeError, match="float16"):
        kernel.int4_linear(torch.randn(2, 64), packed, scale.float(), minimum, 16)
    with pytest.raises(RuntimeError, match="ceil"):  # 17 outputs need two blocks
        kernel.int4_linear(torch.randn(2, 64), packed, scale, minimum, 17)
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize(torch.randn(4, 40), "Q4_1")


def test_every_instruction_set_computes_the_same_values(kernel):
    # The integer sums are exact and the float steps run in one order, so AVX2 and portable builds of the
    # kernel agree with this machine's build bit for bit. Each variant is the integer kernels alone behind a
    # torch-op binding, built once per machine (tests/support/kernels.py).
    torch.manual_seed(5)
    weights = pack_q4_1(quantize(torch.randn(48, 576), "Q4_1"))
    x = torch.randn(7, 576)
    want = kernel.int4_linear(x, *weights, 48)
    for isa in variant_isas():
        variant = integer_kernels(isa)
        assert variant.isa() == isa
        assert torch.equal(variant.int4_linear(x, *weights, 48), want), isa


def test_a_fused_projection_computes_each_parts_output(kernel):
    torch.manual_seed(6)
    weights = [torch.randn(n, 64) for n in (48, 20, 20)]  # 20 rows: the fused weight's blocks straddle the parts
    x = torch.randn(3, 64)
    with torch.inference_mode():
        alone = [int4_linear(w, None, kernel)(x) for w in weights]
        assert torch.equal(int4_linear(torch.cat(weights), None, kernel)(x), torch.cat(alone, dim=-1))


def test_int4_method_serves_the_head_in_q8_0_and_a_linear_not_in_groups_of_32_in_float32(kernel):
    method = QuantizeFormat("int4", kernel)
    assert method.make(torch.randn(8, 64), None, ["model.layers.0.mlp.down_proj"], [8]).method.qtype == "Q4_1"
    assert method.make(torch.randn(8, 64), None, ["lm_head"], [8]).method.qtype == "Q8_0"
    assert type(method.make(torch.randn(8, 40), None, ["model.layers.0.mlp.down_proj"], [8])) is PlainLinear
    assert method.made == {"Q4_1": 1, "Q8_0": 1, "F32": 1}


class W4A8Reference(nn.Module):
    """A linear computing w4a8_reference on the Q4_1 buffers of a weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.q4_1 = q4_1(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return w4a8_reference(x.reshape(-1, x.shape[-1]), *self.q4_1).view(*x.shape[:-1], -1)


def _int4_twin(model: nn.Module) -> nn.Module:
    """A copy of `model` computing what the int4 kernels compute, in plain torch: W4A8Reference linears, the head a
    float linear on the Q8_0-dequantized weight and int8-rounded activations, the embedding the Q8_0-dequantized
    rows."""
    twin = copy.deepcopy(model)
    head, embed = twin.get_output_embeddings(), twin.get_input_embeddings()
    twin.set_output_embeddings(RoundedActivations(dequantize(quantize(head.weight, "Q8_0"), "Q8_0", head.in_features)))
    embed.weight = nn.Parameter(dequantize(quantize(embed.weight, "Q8_0"), "Q8_0", embed.embedding_dim),
                                requires_grad=False)
    linears = [(n, m) for n, m in twin.named_modules() if type(m) is nn.Linear and m is not head]
    for name, linear in linears:
        parent, _, attr = name.rpartition(".")
        setattr(twin.get_submodule(parent), attr, W4A8Reference(linear.weight))
    return twin


# 8: chunked prefill and decode batches of up to 8 rows. Every row runs the kernel (Q4_1 takes 4096 rows); the
# dequantize path for more rows is the float linear (test_kernel_computes_the_int8_activation_linear...).
@pytest.mark.parametrize("budget", [64, 8])
def test_int4_engine_matches_transformers_with_the_kernels_arithmetic(kernel, budget):
    reference, ours = build_pair("llama")
    reference = _int4_twin(reference)
    cfg = SluiceConfig()
    cfg.model.quantization = "int4"
    cfg.cache.num_kv_blocks = 64
    cfg.scheduler.max_num_batched_tokens = budget
    cfg.scheduler.max_num_seqs = 16
    engine = LLMEngine(cfg, model=ours, tokenizer=tiny.tokenizer())
    assert engine.dtype == torch.float32
    assert engine.model.lm_head.method.qtype == "Q8_0" and isinstance(engine.model.embed_tokens, GgufEmbedding)
    assert all(type(m) is GgufLinear and m.method.qtype == "Q4_1" and m.method.packed
               for m in engine.model.layers.modules() if hasattr(m, "in_features"))
    assert engine.model.layers[0]._layer_ops is not None  # the fused C++ layer path
    layer = engine.model.layers[0]
    # q/k/v and gate/up: one linear each, fused at load
    assert layer.self_attn.qkv_proj.out_features == 128 and layer.mlp.gate_up_proj.out_features == 256
    prompts = mixed_prompts(12)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    got = [c.token_ids for c in engine.generate(prompts, params)]
    assert all(len(tokens) == MAX_NEW for tokens in got)
    # On this random model a 2e-7 relative nudge of every activation moves the reference's own logits by up to
    # ~0.2 (their spread: ~1.6): each token is checked against the reference's logits at that point of the
    # engine's own text, the argmax or within such a nudge of it (greedy_gaps says why).
    gaps = greedy_gaps(reference, prompts, got)
    assert (gaps <= 0.3).all(), gaps.max()
    assert (gaps == 0).float().mean() > 0.9, gaps  # nearly always the very argmax


def test_int4_refuses_bfloat16():
    _, ours = build_pair("llama")
    cfg = SluiceConfig()
    cfg.model.quantization, cfg.model.dtype = "int4", "bfloat16"
    with pytest.raises(ValueError, match="int4 runs on CPU with float32"):
        LLMEngine(cfg, model=ours, tokenizer=tiny.tokenizer())
