"""ModelRunner driven by hand-built SchedulerOutputs must reproduce transformers' greedy generate."""

from __future__ import annotations

import pytest
import torch

from sluice.kvcache.config import CacheConfig
from sluice.kvcache.kv_tensors import kv_block_bytes
from sluice.scheduling.output import SchedulerOutput
from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.attention.attention_backend import ATTN_IMPLEMENTATION
from sluice.service.attention.paged_attention import KERNEL_ROWS_MAX
from sluice.service.executor.forward_context import get_forward_context
from sluice.service.executor.model_runner import ModelRunner
from tests.support.parity import hf_greedy
from tests.support.runner import Driver, make_runner, prompts, tiny_pair


@pytest.mark.parametrize("arch,owned", [("llama", True), ("qwen2", True), ("qwen3", True), ("llama", False),
                                        ("qwen3", False)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_and_batched_decode_match_generate(arch, owned, block_size):
    """Sluice's own forward, and transformers' model on the paged attention hook (the fallback path)."""
    reference, model = tiny_pair(arch)
    runner = make_runner(model, block_size=block_size, num_blocks=256 // block_size, owned=owned)
    assert owned or model.config._attn_implementation == ATTN_IMPLEMENTATION
    p = prompts()
    n_new = 8
    driver = Driver(runner)
    for rid in "abc":
        driver.add(rid, p[rid])
    driver.step({"a": 16, "b": None})  # a: first chunk (no sample), b: whole prompt
    driver.step({"a": None, "b": 1, "c": None})  # a: second chunk on top of cached context
    driver.add("d", p["d"])
    driver.step({"a": 1, "d": 10, "b": 1, "c": 1})  # decodes around a prefill chunk
    driver.step({"d": None, "c": 1, "a": 1, "b": 1})
    while any(len(driver.outputs(r)) < n_new for r in "abcd"):
        driver.step({r: 1 for r in "abcd" if len(driver.outputs(r)) < n_new})
    for rid in "abcd":
        assert driver.outputs(rid)[:n_new] == hf_greedy(reference, p[rid], n_new), rid


def test_swap_out_and_in_to_other_blocks_continues_identically():
    reference, model = tiny_pair("llama")
    runner = make_runner(model, block_size=4, num_blocks=32, swap_space=0.001)
    assert runner.num_host_blocks > 0
    p = prompts(1)["a"]
    driver = Driver(runner)
    driver.add("a", p)
    driver.step({"a": None})
    driver.step({"a": 1})
    old = driver.blocks["a"]
    host = list(range(len(old)))
    driver.step({}, swap_out=list(zip(old, host, strict=True)))
    runner.kv.kv[:, :, old] = torch.randn_like(runner.kv.kv[:, :, old])  # blocks reused by someone else
    new = [driver.free.pop() for _ in old]
    driver.blocks["a"] = new
    driver.step({"a": 1}, swap_in=list(zip(host, new, strict=True)))  # swap back in, then compute in the same step
    for _ in range(3):
        driver.step({"a": 1})
    assert driver.outputs("a") == hf_greedy(reference, p, 6)


def test_logprobs_and_seeded_sampling_through_the_runner():
    _, model = tiny_pair("qwen2")
    runner = make_runner(model)
    p = prompts(2)
    driver = Driver(runner)
    driver.add("g", p["b"], SamplingParams(temperature=0.0, logprobs=2))
    driver.add("s", p["c"], SamplingParams(temperature=1.0, seed=42))
    driver.step({"g": None, "s": None})
    driver.step({"g": 1, "s": 1})
    lps = driver.logprobs["g"]
    assert len(lps) == 2 and not driver.logprobs["s"]
    for lp, token in zip(lps, driver.outputs("g"), strict=True):
        assert lp.token_id == token and lp.top[0][0] == token and len(lp.top) == 2 and lp.logprob <= 0

    alone = Driver(make_runner(tiny_pair("qwen2")[1]))
    alone.add("s", p["c"], SamplingParams(temperature=1.0, seed=42))
    alone.step({"s": None})
    alone.step({"s": 1})
    assert alone.outputs("s") == driver.outputs("s")


def test_cache_sized_from_memory_budget():
    _, model = tiny_pair("llama")
    cache = CacheConfig(block_size=16, num_kv_blocks=0, kv_cache_memory=0.001, swap_space=0.002)
    runner = ModelRunner(model, cache, "cpu", torch.float32, max_num_batched_tokens=64, max_num_seqs=4)
    per_block = kv_block_bytes(2, 2, 16, 16, torch.float32)
    assert runner.num_kv_blocks == int(0.001 * 2**30) // per_block
    assert runner.num_host_blocks == int(0.002 * 2**30) // per_block
    assert runner.kv_cache_bytes == runner.num_kv_blocks * per_block
    assert runner.execute(SchedulerOutput()).sampled == {}


def test_forward_context_required():
    with pytest.raises(RuntimeError, match="set_forward_context"):
        get_forward_context()


def test_prompt_chunks_go_to_the_decode_kernel_where_it_takes_every_layer():
    """Sluice's own model without sliding windows: every row of a step is a decode row of the C kernel (a prompt
    chunk reads the cache in place, runs of its rows at a time, not one SDPA call per sequence). A window on a
    layer, or transformers' own model, keeps chunks past KERNEL_ROWS_MAX rows on SDPA."""
    reference, model = tiny_pair("llama")
    runner = make_runner(model)
    if runner.decode_kernel is None:
        pytest.skip("the native extension cannot be built here (no C++ compiler?)")
    assert runner.kernel_rows_max == runner.max_num_batched_tokens
    steps = []
    forward = runner.model.compute_logits

    def compute_logits(input_ids, positions, rows):
        steps.append(get_forward_context().attn_metadata)
        return forward(input_ids, positions, rows)

    runner.model.compute_logits = compute_logits
    p = prompts()
    driver = Driver(runner)
    driver.add("a", p["a"])
    driver.step({"a": None})
    assert not steps[0].prefills and steps[0].decode.num_rows == len(p["a"])
    while len(driver.outputs("a")) < 4:
        driver.step({"a": 1})
    assert driver.outputs("a") == hf_greedy(reference, p["a"], 4)
    assert make_runner(tiny_pair("mistral")[1]).kernel_rows_max == KERNEL_ROWS_MAX
    assert make_runner(tiny_pair("llama")[1], owned=False).kernel_rows_max == KERNEL_ROWS_MAX
