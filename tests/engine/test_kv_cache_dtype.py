"""--kv-cache-dtype float16 / bfloat16 under a float32 model: half the cache's bytes, attention still in float32,
and the same tokens however requests are batched, chunked, prefix-cached or preempted."""

from __future__ import annotations

import copy

import pytest
import torch

from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.cli import build_parser
from sluice.service.config import SluiceConfig, config_from_args
from sluice.service.engine.engine import LLMEngine
from tests.support.parity import MAX_NEW, build_pair, make_engine, mixed_prompts


@pytest.fixture(scope="module")
def llama():
    """A tiny random float32 Llama (transformers' copy; each engine gets its own deep copy) and the prompt mix."""
    _, ours = build_pair("llama")
    return ours, mixed_prompts()


def engine(model, kv_cache_dtype: str, *, blocks=400, budget=2048, seqs=16, mode="recompute", prefix=True,
           kernel=True, memory=None) -> LLMEngine:
    """make_engine on a copy of `model` with this cache dtype (and `memory` GiB of cache instead of `blocks`)."""
    cache = dict(kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=prefix, cpu_decode_kernel=kernel)
    if memory is not None:
        cache.update(num_kv_blocks=0, kv_cache_memory=memory)
    return make_engine(copy.deepcopy(model), mode, blocks, budget=budget, cache=cache, max_num_seqs=seqs)


SIXTEEN = ["float16", "bfloat16"]


@pytest.mark.parametrize("kv_cache_dtype", SIXTEEN)
def test_the_same_memory_holds_twice_the_tokens(llama, kv_cache_dtype):
    model, _ = llama
    full, half = (engine(model, d, memory=0.001) for d in ("auto", kv_cache_dtype))
    assert full.dtype == half.dtype == torch.float32  # compute stays float32
    assert full.runner.kv.kv.dtype == torch.float32
    assert half.runner.kv.kv.dtype == getattr(torch, kv_cache_dtype)
    assert half.num_kv_blocks == 2 * full.num_kv_blocks
    assert half.kv_cache_bytes == full.kv_cache_bytes


@pytest.mark.parametrize("kv_cache_dtype,tolerance", [("float16", 0.01), ("bfloat16", 0.1)])
def test_next_token_logprobs_stay_close_to_a_float32_cache(llama, kv_cache_dtype, tolerance):
    """The rounding costs little, float16's (11 significant bits) less than bfloat16's (8): the same first token
    for every prompt, top-5 logprobs within the tolerance (a float32 cache gives identical ones, so a cache that
    stored garbage or the wrong rows fails here)."""
    model, prompts = llama
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    runs = {d: engine(model, d).generate(prompts, params) for d in ("auto", kv_cache_dtype)}
    worst = 0.0
    for full, half in zip(runs["auto"], runs[kv_cache_dtype], strict=True):
        assert full.token_ids == half.token_ids
        a, b = dict(full.logprobs[0].top), dict(half.logprobs[0].top)
        worst = max(worst, *(abs(a[t] - b[t]) for t in a.keys() & b.keys()))
    assert 0 < worst < tolerance


@pytest.mark.parametrize("kv_cache_dtype,mode,kernel", [("bfloat16", "recompute", True), ("bfloat16", "swap", False),
                                                         ("float16", "swap", True), ("float16", "recompute", False)])
def test_the_same_tokens_however_requests_are_batched(llama, kv_cache_dtype, mode, kernel):
    """Every path rounds K/V where they are stored and reads them back the same way (a chunk's own new keys
    included): chunked prefill, prefix hits and preemption give the tokens of one request at a time."""
    model, prompts = llama
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    alone = engine(model, kv_cache_dtype, seqs=1, prefix=False, kernel=kernel).generate(prompts, params)
    busy = engine(model, kv_cache_dtype, blocks=24, budget=64, mode=mode, kernel=kernel)
    preemptions = []
    busy.stat_loggers.append(lambda s: preemptions.append(s.num_preemptions_recompute + s.num_preemptions_swap))
    if kernel and busy.runner.decode_kernel is None:
        pytest.skip("the native extension cannot be built here (no C++ compiler?)")
    assert (busy.runner.decode_kernel is not None) == kernel
    batched = busy.generate(prompts, params)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert sum(preemptions) > 0
    stats = busy.kv_stats()
    assert stats["free_blocks"] == stats["total_blocks"] and stats["free_host_blocks"] == stats["total_host_blocks"]


def test_the_flag_and_its_refusals():
    parser = build_parser()
    assert config_from_args(parser.parse_args(["serve", "--kv-cache-dtype", "bfloat16"])).cache.kv_cache_dtype == \
        "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-cache-dtype", "fp8"])
    cfg = SluiceConfig()
    cfg.cache.kv_cache_dtype = "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float16, bfloat16"):
        cfg.validate()
