"""Memory sizing: swap space and KV cache 'auto' sizes, on CPU from cgroup/meminfo files, on CUDA from a profile."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from sluice.kvcache.config import CacheConfig, gib_or_auto
from sluice.service.cli import build_parser
from sluice.service.config import SluiceConfig, config_from_args
from sluice.service.executor.model_runner import ModelRunner

GiB = 1 << 30


def tiny_model():
    from sluice.service.attention.attention_backend import register
    from sluice.service.executor.forward_context import get_forward_context

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    # the paged attention, as ModelRunner sets it: profiles run it
    model.set_attn_implementation(register(get_forward_context))
    return model


def cli(argv: list[str]) -> SluiceConfig:
    return config_from_args(build_parser().parse_args(["serve", *argv]))


# ---- swap space


def test_swap_space_auto_is_zero_on_cpu_unless_swapping_and_vllms_four_gib_on_cuda():
    cache = CacheConfig()
    assert cache.swap_space == "auto"
    assert cache.swap_space_gib("cpu") == 0.0 and cache.swap_space_gib("cuda") == 4.0
    assert cache.swap_space_gib("cpu", "recompute", 2.0) == 0.0
    # Asking for swap preemption gets a pool as large as the cache, up to vLLM's 4 GiB.
    assert cache.swap_space_gib("cpu", "swap", 2.0) == 2.0 and cache.swap_space_gib("cpu", "swap", 11.2) == 4.0
    assert cache.swap_space_gib("cuda", "swap", 11.2) == 4.0
    for explicit in (0.5, "0.5", 0, "0"):
        for mode in ("recompute", "swap"):
            assert CacheConfig(swap_space=explicit).swap_space_gib("cpu", mode, 2.0) == float(explicit)
            assert CacheConfig(swap_space=explicit).swap_space_gib("cuda", mode, 2.0) == float(explicit)


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


def test_cpu_runner_gets_a_host_pool_only_when_swapping_and_keeps_an_explicit_one():
    model = tiny_model()
    runner = ModelRunner(model, CacheConfig(num_kv_blocks=8), "cpu", torch.float32, 64, 4)
    assert runner.num_host_blocks == 0 and runner.kv.host_num_bytes == 0
    runner = ModelRunner(model, CacheConfig(num_kv_blocks=8), "cpu", torch.float32, 64, 4, preemption_mode="swap")
    assert runner.num_host_blocks == 8 and runner.kv.host_num_bytes == runner.kv_cache_bytes
    runner = ModelRunner(model, CacheConfig(num_kv_blocks=8, swap_space=0.001), "cpu", torch.float32, 64, 4)
    assert runner.num_host_blocks > 0


def swap_engine(swap_space):
    from sluice.service.engine.engine import LLMEngine
    from tests.support import tiny

    cfg = SluiceConfig()
    cfg.model.device, cfg.model.dtype = "cpu", "float32"
    cfg.cache.num_kv_blocks, cfg.cache.swap_space = 16, swap_space
    cfg.scheduler.preemption_mode = "swap"
    model = tiny_model()
    model.resize_token_embeddings(len(tiny.tokenizer()))
    return LLMEngine(cfg, model=model, tokenizer=tiny.tokenizer())


def test_swap_mode_gets_a_host_pool_by_default_or_refuses_to_start_without_one():
    engine = swap_engine("auto")
    assert engine.runner.num_host_blocks == 16 and engine.kv_stats()["total_host_blocks"] == 16
    for none in (0, 1e-9):  # no pool, or one too small for a block: a start-up error that says why
        with pytest.raises(ValueError, match="--preemption-mode swap needs a host swap pool.*--swap-space"):
            swap_engine(none)


# ---- KV cache size on CPU: cgroup limit / MemAvailable


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def proc_cgroup(tmp_path, text: str = "0::/\n"):
    return write(tmp_path / "proc-self-cgroup", text)


def test_cgroup_memory_limit_reads_v2_then_v1(tmp_path):
    from sluice.cpu import cgroup_memory_limit

    own = proc_cgroup(tmp_path)
    assert cgroup_memory_limit(tmp_path / "none", own) is None  # nothing mounted
    write(tmp_path / "v2" / "memory.max", "max\n")
    assert cgroup_memory_limit(tmp_path / "v2", own) is None
    write(tmp_path / "v2" / "memory.max", f"{2 * GiB}\n")
    assert cgroup_memory_limit(tmp_path / "v2", own) == (2 * GiB, str(tmp_path / "v2" / "memory.max"))
    write(tmp_path / "v1" / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "unlimited"
    assert cgroup_memory_limit(tmp_path / "v1", own) is None
    write(tmp_path / "v1" / "memory" / "memory.limit_in_bytes", f"{GiB}\n")
    v1_file = tmp_path / "v1" / "memory" / "memory.limit_in_bytes"
    assert cgroup_memory_limit(tmp_path / "v1", own) == (GiB, str(v1_file))


def test_cgroup_memory_limit_is_the_tightest_over_own_cgroup_and_ancestors(tmp_path):
    from sluice.cpu import cgroup_memory_limit, own_cgroups

    # cgroup v2, not namespaced: /proc/self/cgroup names the process's cgroup below the mount.
    own = proc_cgroup(tmp_path, "0::/kubepods/pod1/ctr\n")
    assert own_cgroups(own) == ("/kubepods/pod1/ctr", "/")
    root = tmp_path / "v2"
    write(root / "kubepods" / "memory.max", f"{64 * GiB}\n")
    write(root / "kubepods" / "pod1" / "memory.max", f"{6 * GiB}\n")
    write(root / "kubepods" / "pod1" / "ctr" / "memory.max", "max\n")
    assert cgroup_memory_limit(root, own) == (6 * GiB, str(root / "kubepods" / "pod1" / "memory.max"))
    # cgroup v1: the memory controller's line; a path missing under the mount falls back to its parents.
    own = proc_cgroup(tmp_path, "12:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n")
    assert own_cgroups(own) == ("/", "/docker/abc")
    root = tmp_path / "v1"
    write(root / "memory" / "memory.limit_in_bytes", f"{3 * GiB}\n")
    assert cgroup_memory_limit(root, own) == (3 * GiB, str(root / "memory" / "memory.limit_in_bytes"))
    write(root / "memory" / "docker" / "abc" / "memory.limit_in_bytes", f"{GiB}\n")
    assert cgroup_memory_limit(root, own)[0] == GiB
    assert own_cgroups(tmp_path / "absent") == ("/", "/")


def meminfo(tmp_path, available_gib: float | None):
    lines = ["MemTotal:       32000000 kB", "MemFree:         1000000 kB"]
    if available_gib is not None:
        lines.append(f"MemAvailable:   {int(available_gib * GiB / 1024)} kB")
    return write(tmp_path / "meminfo", "\n".join(lines) + "\n")


def test_mem_available(tmp_path):
    from sluice.cpu import mem_available

    assert mem_available(meminfo(tmp_path, 10)) == 10 * GiB
    assert mem_available(meminfo(tmp_path, None)) is None
    assert mem_available(tmp_path / "absent") is None


def test_cpu_budget_is_half_of_what_is_left_after_the_weights(tmp_path):
    from sluice.service.executor.kv_sizing import cpu_kv_budget

    no_cgroup, own = tmp_path / "nocg", proc_cgroup(tmp_path)
    # MemAvailable is read with the model loaded: the weights are already out of it.
    b = cpu_kv_budget(2 * GiB, cgroup_root=no_cgroup, meminfo=meminfo(tmp_path, 10), proc_cgroup=own)
    assert b.num_bytes == 5 * GiB and "MemAvailable 10.00 GiB" in b.source
    # A cgroup limit of 8 GiB with 2 GiB of weights leaves 6: half of it.
    write(tmp_path / "cg" / "memory.max", str(8 * GiB))
    b = cpu_kv_budget(2 * GiB, cgroup_root=tmp_path / "cg", meminfo=meminfo(tmp_path, 20), proc_cgroup=own)
    assert b.num_bytes == 3 * GiB and "cgroup memory limit 8.00 GiB" in b.source and "2.00 GiB weights" in b.source
    # ... unless the machine has less available than the limit: never more than either.
    b = cpu_kv_budget(2 * GiB, cgroup_root=tmp_path / "cg", meminfo=meminfo(tmp_path, 4), proc_cgroup=own)
    assert b.num_bytes == 2 * GiB and "MemAvailable" in b.source
    assert cpu_kv_budget(2 * GiB, 0.25, tmp_path / "cg", meminfo(tmp_path, 20), own).num_bytes == int(1.5 * GiB)
    # Weights beyond the limit leave nothing (kv_cache_blocks then refuses to start).
    assert cpu_kv_budget(9 * GiB, 0.5, tmp_path / "cg", meminfo(tmp_path, 20), own).num_bytes == 0
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        cpu_kv_budget(GiB, cgroup_root=no_cgroup, meminfo=tmp_path / "absent", proc_cgroup=own)


def fake_host(monkeypatch, limit_gib: float | None, available_gib: float | None):
    from sluice.service.executor import kv_sizing

    monkeypatch.setattr(kv_sizing, "cgroup_memory_limit",
                        lambda root, own: None if limit_gib is None else (int(limit_gib * GiB), "memory.max"))
    monkeypatch.setattr(kv_sizing, "mem_available",
                        lambda path: None if available_gib is None else int(available_gib * GiB))


def test_kv_cache_blocks_precedence(monkeypatch):
    from sluice.service.executor.kv_sizing import KVShape, kv_cache_blocks, model_weight_bytes

    model = tiny_model()
    shape = KVShape.of(model, 16, torch.float32)
    assert shape.block_bytes == 2 * 2 * 16 * 2 * 8 * 4
    cpu = torch.device("cpu")
    fake_host(monkeypatch, None, 0.01)
    assert kv_cache_blocks(model, CacheConfig(num_kv_blocks=7), cpu, shape, 64, 4) == (7, "--num-kv-blocks")
    n, source = kv_cache_blocks(model, CacheConfig(kv_cache_memory="0.002"), cpu, shape, 64, 4)
    assert (n, source) == (int(0.002 * GiB) // shape.block_bytes, "--kv-cache-memory 0.002 GiB")
    # 'auto' on CPU: the smallest of 4 GiB, what the limits can use and half of what is left. Here the limits:
    # 4 sequences x the model's 256 tokens (16 blocks each) = 64 blocks, or x the configured 64 tokens = 16.
    n, source = kv_cache_blocks(model, CacheConfig(), cpu, shape, 64, 4)
    assert n == 64 and source.startswith("auto: ") and source.split(",")[0].endswith("for 4 sequences x 256 tokens")
    assert "--kv-cache-memory" in source and "--num-kv-blocks" in source  # how to raise it
    n, source = kv_cache_blocks(model, CacheConfig(), cpu, shape, 64, 4, max_model_len=64)
    assert n == 16 and "4 sequences x 64 tokens" in source
    fake_host(monkeypatch, None, 0.0001)  # 105 KiB available: half of it
    n, source = kv_cache_blocks(model, CacheConfig(), cpu, shape, 64, 4)
    assert n == int(0.0001 * GiB * 0.5) // shape.block_bytes and source.startswith("auto: 0.5 x")
    fake_host(monkeypatch, 0.00005, 0.01)  # a 52 KiB cgroup: less than the weights
    assert model_weight_bytes(model) > 0.00005 * GiB
    with pytest.raises(ValueError, match="too small for a single block"):
        kv_cache_blocks(model, CacheConfig(), cpu, shape, 64, 4)


def test_model_weight_bytes_counts_each_storage_once_and_packed_weights():
    from sluice.service.config import ModelConfig
    from sluice.service.executor.kv_sizing import model_weight_bytes
    from sluice.service.executor.layers.packed_linear import can_prepack
    from sluice.service.executor.weight_prep import prepare_weights

    model = tiny_model()
    plain = model_weight_bytes(model)
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert plain == sum(params.values()) + buffers
    if can_prepack(torch.device("cpu"), torch.float32):
        owned = prepare_weights(model, ModelConfig(), torch.device("cpu"), torch.float32)
        assert model_weight_bytes(owned) >= plain - buffers  # same weights, oneDNN's layout (may pad)


@pytest.mark.parametrize("field,bad,match", [
    ("kv_cache_memory", "lots", "kv_cache_memory"), ("kv_cache_memory", -1, "kv_cache_memory"),
    ("kv_cache_memory", 0, "kv_cache_memory must be > 0"), ("gpu_memory_utilization", 0.0, "gpu_memory_utilization"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization"),
])
def test_memory_knobs_are_validated(field, bad, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig(**{field: bad}).validate()
    CacheConfig(num_kv_blocks=4, kv_cache_memory=0).validate()  # blocks given: the size is not used


def test_kv_cache_memory_flag_takes_a_number_or_auto(capsys, monkeypatch):
    assert cli([]).cache.kv_cache_memory == "auto"
    assert cli(["--kv-cache-memory", "1.5"]).cache.kv_cache_memory == 1.5
    assert cli(["--gpu-memory-utilization", "0.8"]).cache.gpu_memory_utilization == 0.8
    with pytest.raises(SystemExit):
        cli(["--kv-cache-memory", "half"])
    err = capsys.readouterr().err
    assert "--kv-cache-memory: invalid 'auto' or GiB value: 'half'" in err
    monkeypatch.setenv("SLUICE_KV_CACHE_MEMORY", "lots")
    with pytest.raises(SystemExit):
        cli([])
    assert "SLUICE_KV_CACHE_MEMORY='lots' is not a valid 'auto' or GiB" in capsys.readouterr().err


def engine_config(**cache):
    cfg = SluiceConfig()
    cfg.model.device, cfg.model.dtype = "cpu", "float32"
    for k, v in cache.items():
        setattr(cfg.cache, k, v)
    return cfg


def tiny_engine(cfg):
    from sluice.service.engine.engine import LLMEngine
    from tests.support import tiny

    model = tiny_model()
    model.resize_token_embeddings(len(tiny.tokenizer()))
    return LLMEngine(cfg, model=model, tokenizer=tiny.tokenizer())


def test_auto_size_is_logged_before_max_model_len_is_checked_against_it(monkeypatch, caplog):
    fake_host(monkeypatch, None, 1 / 1024)  # half of 1 MiB: 128 blocks of 16 tokens (4 KiB each) for this model
    with caplog.at_level(logging.INFO, logger="sluice.engine"):
        engine = tiny_engine(engine_config())
    assert engine.num_kv_blocks == 128
    assert "KV cache: 128 blocks x 16 tokens = 2048 tokens, 0.5 MiB float32 on cpu" in caplog.text
    assert "MemAvailable 1.0 MiB" in caplog.text
    caplog.clear()
    cfg = engine_config()
    cfg.scheduler.max_model_len = 4096
    with caplog.at_level(logging.INFO, logger="sluice.engine"), pytest.raises(ValueError, match="max_model_len 4096"):
        tiny_engine(cfg)
    assert "KV cache: 128 blocks" in caplog.text  # the refusal comes with the size it was refused against


# ---- KV cache size on CUDA: profile, then utilization * total - (weights + activations)


class FakeCuda:
    """Stands in for kv_sizing.cuda_memory: the device state before, during and after the profile forward."""

    def __init__(self, total, weights, peak, free_after):
        self.total, self.weights, self.peak, self.free_after = total, weights, peak, free_after
        self.calls = []

    def __call__(self, device, reset_peak=False):
        from sluice.service.executor.kv_sizing import CudaMemory

        self.calls.append(reset_peak)
        if len(self.calls) == 1:  # before: the weights, nothing else
            return CudaMemory(self.total - self.weights, self.total, self.weights, self.weights)
        if len(self.calls) == 2:  # right after the forward: the peak
            return CudaMemory(0, self.total, self.weights, self.peak)
        return CudaMemory(self.free_after, self.total, self.weights, self.weights)


def gpu_budget(monkeypatch, fake, utilization=0.9, tokens=64):
    from sluice.service.executor import kv_sizing

    monkeypatch.setattr(kv_sizing, "cuda_memory", fake)
    seen = []
    model = tiny_model()
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    shape = kv_sizing.KVShape.of(model, 16, torch.float32)
    # The profile forward itself runs for real, on the CPU: same code, only the memory figures are faked.
    budget = kv_sizing.gpu_kv_budget(model, shape, torch.device("cpu"), utilization, tokens, 8)
    assert seen == [(1, tokens)] and fake.calls == [True, False, True]
    return budget


def test_gpu_budget_is_utilization_of_total_less_weights_and_peak_activations(monkeypatch):
    b = gpu_budget(monkeypatch, FakeCuda(total=80 * GiB, weights=10 * GiB, peak=12 * GiB, free_after=69 * GiB))
    assert b.num_bytes == int(0.9 * 80 * GiB) - 12 * GiB
    assert "0.9 x 80.00 GiB less 10.00 GiB of weights and 2.00 GiB of peak activations at 64 tokens" in b.source
    b = gpu_budget(monkeypatch, FakeCuda(80 * GiB, 10 * GiB, 12 * GiB, 69 * GiB), utilization=0.5, tokens=32)
    assert b.num_bytes == 40 * GiB - 12 * GiB


def test_gpu_budget_leaves_what_other_processes_hold(monkeypatch):
    b = gpu_budget(monkeypatch, FakeCuda(total=80 * GiB, weights=10 * GiB, peak=12 * GiB, free_after=30 * GiB))
    assert b.num_bytes == 28 * GiB and "30.00 GiB free" in b.source


def test_gpu_budget_refuses_a_model_that_does_not_fit(monkeypatch):
    with pytest.raises(ValueError, match="the model does not fit"):
        gpu_budget(monkeypatch, FakeCuda(total=16 * GiB, weights=14 * GiB, peak=16 * GiB, free_after=2 * GiB))


def test_kv_cache_blocks_on_cuda_uses_the_gpu_budget(monkeypatch):
    from sluice.service.executor import kv_sizing

    calls = []

    def fake(model, shape, device, utilization, tokens, seqs, backend):
        calls.append((device.type, utilization, tokens, seqs, backend))
        return kv_sizing.KVBudget(100 * shape.block_bytes + 1, "auto: fake")

    monkeypatch.setattr(kv_sizing, "gpu_kv_budget", fake)
    model = tiny_model()
    shape = kv_sizing.KVShape.of(model, 16, torch.bfloat16)
    cache = CacheConfig(gpu_memory_utilization=0.7)
    assert kv_sizing.kv_cache_blocks(model, cache, torch.device("cuda"), shape, 2048, 64) == (100, "auto: fake")
    assert calls == [("cuda", 0.7, 2048, 64, "auto")]
    # An explicit size skips the profile altogether.
    assert kv_sizing.kv_cache_blocks(model, CacheConfig(kv_cache_memory=1), torch.device("cuda"), shape, 2048, 64)[0]
    assert len(calls) == 1


# ---- prepacked weights replace the plain ones: no second copy


@pytest.mark.parametrize("tied", [False, True])
def test_prepacked_weights_are_held_once(tied, tmp_path):
    import gc

    from sluice.service.config import ModelConfig
    from sluice.service.executor.kv_sizing import model_weight_bytes
    from sluice.service.executor.layers.packed_linear import PackedLinear, can_prepack
    from sluice.service.executor.weight_prep import load_owned

    if not can_prepack(torch.device("cpu"), torch.float32):
        pytest.skip("no oneDNN in this torch")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    before = model_weight_bytes(plain) - sum(b.numel() * b.element_size() for b in plain.buffers())
    del plain
    gc.collect()
    model = load_owned(tmp_path, config, ModelConfig(), torch.device("cpu"), torch.float32)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 8 + (not tied)  # q/k/v and gate/up fused; a tied head stays plain
    # No plain copy beside a packed one: the same bytes in oneDNN's layout (a little padding at most); a tied
    # head is not copied at all.
    assert not any(hasattr(m, "weight") for m in packed)
    after = model_weight_bytes(model) - sum(b.numel() * b.element_size() for b in model.buffers())
    assert before <= after <= before * 1.05


def test_profile_forward_goes_through_the_runners_attention_backend(monkeypatch):
    from sluice.service.attention.paged_attention import AttentionMetadata
    from sluice.service.executor import kv_sizing

    seen = []
    real = AttentionMetadata.build.__func__
    monkeypatch.setattr(AttentionMetadata, "build",
                        classmethod(lambda cls, *a, **kw: seen.append(kw.get("backend")) or real(cls, *a, **kw)))
    model = tiny_model()
    shape = kv_sizing.KVShape.of(model, 16, torch.float32)
    calls = []
    real_attention = kv_sizing.set_forward_context
    monkeypatch.setattr(kv_sizing, "set_forward_context", lambda ctx: calls.append(ctx) or real_attention(ctx))
    kv_sizing.profile_forward(model, shape, torch.device("cpu"), 40, 4, backend="torch")
    assert seen == ["torch"] and len(calls) == 1
    # the forward wrote its 40 tokens' K/V into the scratch cache: the paged attention really ran
    assert all(k[:3].abs().sum() > 0 for k, _ in calls[0].kv_caches)


def test_cpu_auto_leaves_a_laptop_usable():
    """Issue 21: a 23 GB machine gave SmolLM2-135M an 11.2 GiB cache (half of MemAvailable); now 4 GiB at most."""
    from sluice.service.executor.kv_sizing import KVBudget, KVShape, cpu_auto_budget

    smollm2 = KVShape(30, 3, 64, 16, torch.float32)  # 46,080 bytes a token
    left = KVBudget(int(11.2 * GiB), "auto: 0.5 x 22.40 GiB left, from MemAvailable")
    b = cpu_auto_budget(left, smollm2, 64, 8192)  # 64 x 8192 tokens would take 22.5 GiB
    assert b.num_bytes == 4 * GiB and b.source.startswith("auto: the CPU default 4 GiB, the smallest beside ")
    assert "22.50 GiB for 64 sequences x 8192 tokens" in b.source and "0.5 x 22.40 GiB left" in b.source
    assert b.source.endswith("raise it with --kv-cache-memory GiB or --num-kv-blocks N")
    b = cpu_auto_budget(left, smollm2, 4, 2048)  # what the limits can use: 4 x 2048 tokens
    assert b.num_bytes == 4 * 2048 * 46080 and b.source.startswith("auto: 360.0 MiB for 4 sequences x 2048 tokens")
    small = KVBudget(GiB, "auto: 0.5 x 2.00 GiB left, from a cgroup")
    b = cpu_auto_budget(small, smollm2, 64, 8192)  # a small machine: half of what is left, as before
    assert b.num_bytes == GiB and b.source.startswith("auto: 0.5 x 2.00 GiB left")
    # A context that is not a whole number of blocks still gets its last block.
    assert cpu_auto_budget(left, smollm2, 1, 17).num_bytes == 2 * smollm2.block_bytes
