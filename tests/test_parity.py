"""The correctness oracle: greedy Sluice output == transformers' generate, however requests are batched."""

from __future__ import annotations

import pytest
import torch

from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.config import SluiceConfig
from sluice.service.engine.engine import LLMEngine
from sluice.service.executor.layers.linear import PlainLinear, decode_kernel_wins
from sluice.service.executor.layers.packed_linear import PackedLinear
from sluice.service.executor.models.llama import LlamaForCausalLM
from tests.support import tiny
from tests.support.parity import (
    MAX_NEW,
    build_pair,
    hf_greedy,
    hf_greedy_batch,
    make_engine,
    mixed_prompts,
    reference_case,
)


def instrument(engine) -> dict:
    """Record which paths a run really took: preemptions by mode and phase, cross-request prefix hits, chunked
    prefills, and how many decode-attention calls went to the C kernel or to the torch path."""
    import sluice.service.attention.paged_attention as pa

    seen = {"swap": 0, "recompute": 0, "preempted_in_decode": 0, "cross_request_hits": 0, "chunks": 0,
            "kernel_calls": 0, "torch_decode_calls": 0}
    sched, kv, runner = engine.scheduler, engine.kv_manager, engine.runner

    def record(stats):
        seen["recompute"] += stats.num_preemptions_recompute
        seen["swap"] += stats.num_preemptions_swap

    engine.stat_loggers.append(record)
    preempt = sched._preempt

    def spy_preempt(victim, out):
        seen["preempted_in_decode"] += victim.num_output_tokens > 0
        return preempt(victim, out)

    sched._preempt = spy_preempt
    lookup = kv.get_computed_blocks

    def spy_lookup(request):
        hits = lookup(request)
        # At its first admission a request owns no blocks: a hit can only be another request's prefix.
        if hits and request.num_preemptions == 0 and request.num_computed_tokens == 0:
            seen["cross_request_hits"] += 1
        return hits

    kv.get_computed_blocks = spy_lookup
    execute = runner.execute

    def spy_execute(out):
        seen["chunks"] += sum(1 for s in out.scheduled if not s.sample)
        return execute(out)

    runner.execute = spy_execute
    if runner.decode_kernel is not None:
        kernel = runner.decode_kernel

        class CountingKernel:
            def supports(self, *args):
                return kernel.supports(*args)

            def plan(self, *args):
                return kernel.plan(*args)

            def decode_step(self, *args):
                seen["kernel_calls"] += 1
                return kernel.decode_step(*args)

        runner.decode_kernel = CountingKernel()
    torch_path = pa._decode_attention

    def spy_decode(query, key_cache, value_cache, decode, *args):
        kernel = decode.kernel
        if kernel is None or not kernel.supports(query, key_cache):
            seen["torch_decode_calls"] += 1
        return torch_path(query, key_cache, value_cache, decode, *args)

    pa._decode_attention = spy_decode
    seen["restore"] = lambda: setattr(pa, "_decode_attention", torch_path)
    return seen


def check_paths(seen: dict, mode: str, decode_path: str) -> None:
    """The run reached what the parity claim is about, in the mode it claims."""
    seen.pop("restore")()
    assert seen["chunks"], "no prefill was split into chunks"
    assert seen["cross_request_hits"] > 0, "no prefix hit on another request's blocks"
    assert seen[mode] > 0, f"no {mode} preemption happened ({seen})"
    if mode == "swap":
        assert seen["swap"] > seen["recompute"] // 4, f"swap mode ran mostly on recompute fallbacks ({seen})"
    assert seen["preempted_in_decode"] > 0, "no request was preempted while decoding"
    if decode_path == "windowed":  # kernel within the window, SDPA with the window's mask past it: both are fine
        pass
    elif decode_path == "kernel":
        assert seen["kernel_calls"] > 0 and seen["torch_decode_calls"] == 0, seen
    else:
        assert seen["torch_decode_calls"] > 0 and seen["kernel_calls"] == 0, seen


def assert_owned(engine) -> None:
    """The engine runs Sluice's own forward, not transformers' model: a supported architecture never falls back."""
    assert isinstance(engine.model, LlamaForCausalLM), type(engine.model)
    assert not any(type(m).__module__.startswith("transformers") for m in engine.model.modules())


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_parity_under_chunking_prefix_hits_and_preemption(arch, mode):
    ours, prompts, expected = reference_case(arch)
    engine = make_engine(ours, mode, num_blocks=24)
    assert_owned(engine)
    decode_path = "kernel" if engine.runner.decode_kernel is not None else "torch"
    if arch == "mistral":  # steps whose sequences outgrow the 64-token window decode on SDPA with its mask
        decode_path = "windowed"
    # the default fp32 linears: oneDNN-packed, decode-sized calls in the C++ GEMV on that layout where it builds
    if decode_kernel_wins(torch.float32):
        assert all(m.method.gemv_layout for m in engine.model.modules() if isinstance(m, PackedLinear))
        assert not any(isinstance(m, PlainLinear) for m in engine.model.modules())  # the head is not tied here
    seen = instrument(engine)
    results = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))

    for i, (got, want) in enumerate(zip(results, expected, strict=True)):
        assert got.token_ids == want, f"prompt {i} (len {len(prompts[i])}) diverged"
    check_paths(seen, mode, decode_path)
    kv = engine.kv_stats()
    assert kv["free_blocks"] == kv["total_blocks"] and kv["free_host_blocks"] == kv["total_host_blocks"]


def test_greedy_parity_without_prepacking_on_the_torch_decode_path():
    """Plain weights (`--no-prepack-weights`: the plain-layout decode GEMV) and the torch decode attention,
    under swap preemption."""
    reference, ours = build_pair("llama")
    prompts = mixed_prompts()
    expected = [hf_greedy(reference, p, MAX_NEW) for p in prompts]
    cfg = SluiceConfig()
    cfg.model.device, cfg.model.dtype = "cpu", "float32"
    cfg.model.prepack_weights = False
    cfg.cache.cpu_decode_kernel = False
    cfg.cache.num_kv_blocks, cfg.cache.swap_space = 24, 0.01
    cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs = 64, 16
    cfg.scheduler.preemption_mode = "swap"
    engine = LLMEngine(cfg, model=ours, tokenizer=tiny.tokenizer())
    assert_owned(engine)
    assert not any(isinstance(m, PackedLinear) for m in engine.model.modules())
    assert all(m.method.decode_kernel == decode_kernel_wins(torch.float32) for m in engine.model.modules()
               if isinstance(m, PlainLinear))
    seen = instrument(engine)
    results = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert [r.token_ids for r in results] == expected
    check_paths(seen, "swap", "torch")


def test_parity_with_priority_policy_and_tiny_blocks():
    reference, ours = build_pair("llama")
    prompts = mixed_prompts(8, seed=3)
    expected = [hf_greedy(reference, p, 12) for p in prompts]
    engine = make_engine(ours, "recompute", num_blocks=160, block_size=1, budget=37, scheduling_policy="priority")
    results = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0),
                              priorities=[i % 3 for i in range(8)])
    assert [r.token_ids for r in results] == expected


@pytest.mark.slow
def test_smollm2_parity(smollm2):
    model_ref, model_ours, tokenizer = smollm2
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a land far away,",
        "The three primary colors are",
        "Water boils at a temperature of",
        "A haiku about the sea:",
        "To make a cup of tea, first",
        "The quick brown fox",
    ]
    shared = "You are a helpful assistant. Answer briefly and precisely. "
    prompts = [tokenizer.encode(t) for t in texts] + [tokenizer.encode(shared * 3 + t) for t in texts]
    expected = hf_greedy_batch(model_ref, prompts, 12)
    cfg_blocks = 20  # small enough to force preemption with 16 concurrent requests
    for mode in ("recompute", "swap"):
        engine = LLMEngine(_smollm_config(mode, cfg_blocks), model=model_ours, tokenizer=tokenizer)
        assert_owned(engine)
        decode_path = "kernel" if engine.runner.decode_kernel is not None else "torch"
        seen = instrument(engine)
        results = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
        for i, (got, want) in enumerate(zip(results, expected, strict=True)):
            assert got.token_ids == want, f"{mode}: prompt {i} diverged"
        check_paths(seen, mode, decode_path)


def _smollm_config(mode: str, num_blocks: int) -> SluiceConfig:
    cfg = SluiceConfig()
    cfg.model.device, cfg.model.dtype = "cpu", "float32"
    cfg.cache.num_kv_blocks = num_blocks
    cfg.cache.swap_space = 0.05
    cfg.scheduler.max_num_batched_tokens = 48
    cfg.scheduler.preemption_mode = mode
    return cfg
