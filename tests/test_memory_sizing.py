"""Memory sizing: swap space and KV cache 'auto' sizes, on CPU from cgroup/meminfo files, on CUDA from a profile."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from sluice.kvcache.config import CacheConfig, gib_or_auto
from sluice.service.cli import build_parser
from sluice.service.config import SluiceConfig, config_from_args
from sluice.service.engine.model_runner import ModelRunner

GiB = 1 << 30


def tiny_model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )
    return transformers.LlamaForCausalLM(config).eval()


def cli(argv: list[str]) -> SluiceConfig:
    return config_from_args(build_parser().parse_args(["serve", *argv]))


# ---- swap space


def test_swap_space_auto_is_zero_on_cpu_and_vllms_four_gib_on_cuda():
    cache = CacheConfig()
    assert cache.swap_space == "auto"
    assert cache.swap_space_gib("cpu") == 0.0 and cache.swap_space_gib("cuda") == 4.0
    for explicit in (0.5, "0.5", 0, "0"):
        assert CacheConfig(swap_space=explicit).swap_space_gib("cpu") == float(explicit)
        assert CacheConfig(swap_space=explicit).swap_space_gib("cuda") == float(explicit)


@pytest.mark.parametrize("bad", [-1.0, "lots", "-2", float("nan"), True, None])
def test_swap_space_rejects_what_is_neither_a_size_nor_auto(bad):
    with pytest.raises(ValueError, match="swap_space"):
        CacheConfig(swap_space=bad).validate()


def test_size_flags_take_a_number_or_auto(monkeypatch):
    assert cli([]).cache.swap_space == "auto"
    assert cli(["--swap-space", "AUTO"]).cache.swap_space == "auto"
    assert cli(["--swap-space", "0.25"]).cache.swap_space == 0.25
    monkeypatch.setenv("SLUICE_SWAP_SPACE", "2")
    assert cli([]).cache.swap_space == 2.0
    with pytest.raises(SystemExit):
        cli(["--swap-space", "lots"])
    assert gib_or_auto(" auto ") == "auto"


def test_cpu_runner_gets_no_host_pool_by_default_and_keeps_an_explicit_one():
    model = tiny_model()
    runner = ModelRunner(model, CacheConfig(num_kv_blocks=8), "cpu", torch.float32, 64, 4)
    assert runner.num_host_blocks == 0 and runner.kv.host_num_bytes == 0
    runner = ModelRunner(model, CacheConfig(num_kv_blocks=8, swap_space=0.001), "cpu", torch.float32, 64, 4)
    assert runner.num_host_blocks > 0


def test_swap_mode_without_host_blocks_says_it_recomputes(caplog):
    from sluice.service.engine.engine import LLMEngine
    from tests import _tiny

    cfg = SluiceConfig()
    cfg.model.device, cfg.model.dtype = "cpu", "float32"
    cfg.cache.num_kv_blocks = 16
    cfg.scheduler.preemption_mode = "swap"
    model = tiny_model()
    model.resize_token_embeddings(len(_tiny.tokenizer()))
    with caplog.at_level(logging.INFO, logger="sluice.engine"):
        engine = LLMEngine(cfg, model=model, tokenizer=_tiny.tokenizer())
    assert engine.runner.num_host_blocks == 0
    assert "falls back to recompute" in caplog.text
