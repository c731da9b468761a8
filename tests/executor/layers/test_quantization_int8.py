"""--quantization int8 (GGUF Q8_0 blocks, int8 activations as llama.cpp's Q8_0): the kernel against plain torch, and
the int8 engine against transformers on the same dequantized weights with its activations rounded as the kernel
rounds them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.config import SluiceConfig
from sluice.service.engine.engine import LLMEngine
from sluice.service.executor.layers.gguf_blocks import GgufBlocks, quantize
from sluice.service.executor.layers.gguf_linear import GgufLinear
from sluice.service.executor.layers.gguf_packs import pack_q8_0
from sluice.service.executor.layers.quant_types import dequantize
from tests.support import tiny
from tests.support.int8_rounding import RoundedActivations, greedy_gaps
from tests.support.parity import MAX_NEW, build_pair, mixed_prompts


def test_quantize_weight_rounds_to_within_half_a_step_per_group():
    torch.manual_seed(0)
    w = torch.randn(33, 96) * torch.linspace(0.01, 3, 33)[:, None]  # very different row ranges
    w[5, 32:64] = 0  # an all-zero group must not divide by zero
    blocks = quantize(w, "Q8_0")
    assert blocks.dtype == torch.uint8 and blocks.shape == (33, 3 * 34)
    q = blocks.reshape(33, 3, 34)[..., 2:].contiguous().view(torch.int8)
    scale = blocks.reshape(33, 3, 34)[..., :2].contiguous().view(torch.float16)[..., 0]
    assert q.abs().max() <= 127
    step = scale.float().repeat_interleave(32, dim=1)
    assert ((dequantize(blocks, "Q8_0", 96) - w).abs() <= step / 2 + 1e-7).all()
    assert (q[5, 1] == 0).all() and scale[5, 1] == 0


def test_weights_that_came_from_q8_0_come_back_exactly():
    # The default model's embedding (its tied head) is dequantized Q8_0: quantizing it again must lose nothing.
    torch.manual_seed(1)
    q = torch.randint(-127, 128, (8, 4, 32))
    q[..., 0] = 127  # Q8_0 maps each group's largest magnitude to +-127
    d = (torch.rand(8, 4) * 0.01 + 1e-3).half().float()
    w = (q.float() * d[..., None]).reshape(8, 128)
    assert torch.equal(dequantize(quantize(w, "Q8_0"), "Q8_0", 128), w)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33])
@pytest.mark.parametrize("in_features", [32, 96, 576])  # 96: an odd number of groups
def test_kernel_and_dequantize_paths_compute_the_dequantized_linear(kernel, rows, in_features):
    torch.manual_seed(rows * 1000 + in_features)
    linear = nn.Linear(in_features, 130, bias=True)
    w = linear.weight.detach()
    layer = GgufLinear(GgufBlocks(quantize(w, "Q8_0"), "Q8_0", in_features), linear.bias.detach(), kernel)
    assert {t.dtype for t in layer.buffers()} == {torch.uint8, torch.float16}  # codes and scales, no float copy
    x = torch.randn(2, rows, in_features)
    with torch.inference_mode():
        assert layer.method.packed and layer.method.max_rows >= 4096  # every call: int8 activations
        rounded = RoundedActivations(layer.dequantized(), linear.bias.detach())
        torch.testing.assert_close(layer(x), rounded(x), rtol=1e-4, atol=1e-4)
        layer.method.max_rows = 0  # the dequantized tiles: the float linear
        want = torch.nn.functional.linear(x, layer.dequantized(), linear.bias)
        torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)


def test_the_kernel_runs_on_every_torch_thread(kernel):
    # Without -fopenmp at::parallel_for silently runs on one thread: the kernel would be right, at half the speed.
    if not torch.backends.openmp.is_available():
        pytest.skip("torch built without OpenMP")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert kernel.parallel_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_the_kernel_refuses_what_it_cannot_read(kernel):
    blocks = quantize(torch.randn(8, 64), "Q8_0")
    with pytest.raises(RuntimeError, match="gguf_linear"):
        kernel.gguf_linear(torch.randn(2, 48), blocks, 8)
    with pytest.raises(RuntimeError, match="gguf_linear"):
        kernel.gguf_linear(torch.randn(2, 64).double(), blocks, 8)
    with pytest.raises(RuntimeError, match="gguf_linear"):
        kernel.gguf_linear(torch.randn(2, 64), blocks[:, :-1].contiguous(), 8)
    codes, scale = pack_q8_0(blocks)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.q8_0_packed_linear(torch.randn(2, 48), codes, scale, 8)
    with pytest.raises(RuntimeError, match="float16"):
        kernel.q8_0_packed_linear(torch.randn(2, 64), codes, scale.float(), 8)
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize(torch.randn(4, 40), "Q8_0")


def _dequantized_twin(model: nn.Module) -> nn.Module:
    """A copy of `model` computing what the int8 engine computes: each linear (the head too) a float linear on the
    Q8_0-dequantized weight whose activations are rounded as the kernel rounds them, the embedding Q8_0 too."""
    twin = copy.deepcopy(model)

    def q8_0(w: torch.Tensor) -> torch.Tensor:
        return dequantize(quantize(w, "Q8_0"), "Q8_0", w.shape[1])

    for name, module in list(twin.named_modules()):
        if type(module) is nn.Linear:
            parent, _, attr = name.rpartition(".")
            setattr(twin.get_submodule(parent) if parent else twin, attr,
                    RoundedActivations(q8_0(module.weight.detach()), module.bias))
    embed = twin.get_input_embeddings()  # kept in Q8_0 too
    embed.weight = nn.Parameter(q8_0(embed.weight.detach()), requires_grad=False)
    return twin


def int8_engine(model, budget: int, dtype: str = "auto", device: str = "cpu") -> LLMEngine:
    cfg = SluiceConfig()
    cfg.model.device, cfg.model.dtype, cfg.model.quantization = device, dtype, "int8"
    cfg.cache.num_kv_blocks = 64
    cfg.scheduler.max_num_batched_tokens = budget
    cfg.scheduler.max_num_seqs = 16
    return LLMEngine(cfg, model=model, tokenizer=tiny.tokenizer())


def test_int8_needs_cpu_float32_and_a_known_name():
    _, ours = build_pair("llama")
    with pytest.raises(ValueError, match="float32"):
        int8_engine(ours, 64, dtype="bfloat16")
    cfg = SluiceConfig()
    cfg.model.quantization = "int3"
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8"):
        LLMEngine(cfg, model=ours, tokenizer=tiny.tokenizer())


@pytest.mark.parametrize("budget", [64, 8])  # 8: chunked prefill, decode batches of up to 8 rows
def test_int8_engine_matches_transformers_on_the_dequantized_weights(kernel, budget):
    reference, ours = build_pair("llama")
    reference = _dequantized_twin(reference)
    engine = int8_engine(ours, budget)
    assert all(type(m) is not nn.Linear for m in engine.model.modules())
    assert isinstance(engine.model.lm_head, GgufLinear) and engine.model.lm_head.method.qtype == "Q8_0"
    prompts = mixed_prompts(12)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    got = [c.token_ids for c in engine.generate(prompts, params)]
    gaps = greedy_gaps(reference, prompts, got)  # the argmax, or within an activation rounding's nudge of it
    assert (gaps <= 0.3).all(), gaps.max()
    assert (gaps == 0).float().mean() > 0.9, gaps


def test_int8_method_quantizes_whole_groups_only():
    from sluice.service.executor.layers.gguf_linear import QuantizeFormat
    from sluice.service.executor.layers.linear import PlainLinear

    method = QuantizeFormat("int8")
    assert method.make(torch.randn(8, 64), None, ["model.layers.0.self_attn.o_proj"], [8]).method.qtype == "Q8_0"
    assert type(method.make(torch.randn(8, 50), None, ["lm_head"], [8])) is PlainLinear  # no whole groups of 32
