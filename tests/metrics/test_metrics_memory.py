"""/metrics says what is resident and why: weights, the KV blocks ever used (their pages, and only theirs, are
resident), the swap blocks ever used, and the rest of the process; beside what the KV cache set aside."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY, CollectorRegistry

from sluice.cpu import resident_bytes
from sluice.kvcache.kv_tensors import KVTensors
from sluice.kvcache.manager import KVCacheManager
from sluice.metrics.families import MEMORY_KINDS
from sluice.metrics.prometheus import SluiceMetrics, render_latest
from sluice.scheduling.sampling_params import SamplingParams

MODEL = "mem"
PAGE = 4096


def resident(reg: CollectorRegistry, kind: str, model: str = MODEL) -> float | None:
    return reg.get_sample_value("sluice_memory_resident_bytes", {"model_name": model, "kind": kind})


def reserved(reg: CollectorRegistry, kind: str, model: str = MODEL) -> float | None:
    return reg.get_sample_value("sluice_memory_reserved_bytes", {"model_name": model, "kind": kind})


def mapping_rss(address: int) -> int:
    """Resident bytes of the memory mapping that holds `address` (/proc/self/smaps)."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            found = int(head[1], 16) <= address < int(head[2], 16)
        elif found and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise LookupError(f"no mapping holds {address:#x}")


def test_the_gauges_exist_before_anything_is_watched():
    reg = CollectorRegistry()
    SluiceMetrics(MODEL, reg)
    assert [resident(reg, kind) for kind in MEMORY_KINDS] == [0.0] * len(MEMORY_KINDS)
    assert reserved(reg, "kv_cache") == reserved(reg, "kv_swap") == 0.0


def test_kv_bytes_follow_the_blocks_ever_used_not_those_in_use():
    reg = CollectorRegistry()
    kv = KVTensors(33, 2, 2, 16, 16, torch.float16, "cpu", num_host_blocks=8)  # 32 blocks and the scratch one
    manager = KVCacheManager(32, 16, True, 8)
    block = kv.num_bytes // 33
    SluiceMetrics(MODEL, reg).watch_memory(1 << 20, kv, manager)
    assert reserved(reg, "kv_cache") == kv.num_bytes and reserved(reg, "kv_swap") == kv.host_num_bytes
    assert resident(reg, "weights") == 1 << 20 and resident(reg, "kv_cache") == resident(reg, "kv_swap") == 0
    first = manager.pool.get_new_blocks(3)
    assert resident(reg, "kv_cache") == 3 * block
    manager.pool.free_blocks(first)
    again = manager.pool.get_new_blocks(4)  # freed blocks (nothing cached) are reused before never-used ones
    assert sorted(b.block_id for b in again) == [0, 1, 2, 3] and resident(reg, "kv_cache") == 4 * block
    manager.pool.free_blocks(again)
    manager.pool.get_new_blocks(32)  # every block, in use at once
    assert resident(reg, "kv_cache") == 32 * block <= reserved(reg, "kv_cache")
    slots = manager.swap_space.allocate(2)
    manager.swap_space.free(slots)
    manager.swap_space.allocate(3)  # the two freed slots first, then one never used
    assert resident(reg, "kv_swap") == 3 * kv.host_num_bytes // 8
    # other: the process's resident set less what the kinds above hold in host memory (it moves between reads)
    rest = resident_bytes() - (1 << 20) - 32 * block - 3 * kv.host_num_bytes // 8
    assert resident(reg, "other") == pytest.approx(rest, abs=8 << 20) and resident(reg, "other") > 0
    del kv, manager
    gc.collect()  # the registry does not keep a cache alive; a gone one reads 0
    assert resident(reg, "kv_cache") == resident(reg, "kv_swap") == 0


def test_helpers_are_the_child_processes_own_memory():
    import subprocess
    import sys

    reg = CollectorRegistry()
    kv = KVTensors(9, 2, 2, 16, 16, torch.float16, "cpu")
    SluiceMetrics(MODEL, reg).watch_memory(0, kv, KVCacheManager(8, 16, True))
    code = "import time; b = bytearray(48 << 20); b[::4096] = b'x' * len(b[::4096]); print(1, flush=True); " \
           "time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
        with_child = resident(reg, "helpers")
    finally:
        child.kill()
        child.wait()
    assert with_child - resident(reg, "helpers") >= 48 << 20  # what the child wrote, and gone with it


def test_a_served_engine_reports_its_resident_memory_on_metrics(model_dir):
    from sluice.service.executor.kv_sizing import model_weight_bytes
    from tests.support.tiny import tiny_engine

    engine = tiny_engine(model_dir, 64)
    name, kv = engine.served_model_name, engine.runner.kv
    block = kv.num_bytes // kv.num_blocks
    assert resident(REGISTRY, "kv_cache", name) == 0  # nothing written yet: the cache holds no pages
    assert reserved(REGISTRY, "kv_cache", name) == kv.num_bytes
    prompts = [f"Streaming tokens over server-sent events, request {i}, one chunk at a time." for i in range(6)]
    engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    used = engine.kv_manager.pool.num_touched
    assert used >= 6 and resident(REGISTRY, "kv_cache", name) == used * block
    assert resident(REGISTRY, "weights", name) == model_weight_bytes(engine.model) > 0
    # The gauge is what the kernel holds for the cache: the mapping's own resident pages, give or take the page
    # at each end of every (K or V, layer) plane, where a block shares a page with its neighbour.
    planes = 2 * engine.model.config.num_hidden_layers
    assert abs(mapping_rss(kv.kv.data_ptr()) - used * block) <= planes * (PAGE + block // planes)
    body = render_latest()[0].decode()
    assert "process_resident_memory_bytes" in body  # prometheus_client's process collector: the whole
    found = {kind: resident(REGISTRY, kind, name) for kind in MEMORY_KINDS}
    assert found["other"] > 0 and REGISTRY.get_sample_value("process_resident_memory_bytes") == pytest.approx(
        found["weights"] + found["kv_cache"] + found["kv_swap"] + found["other"], rel=0.05)
