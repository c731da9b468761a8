"""KV tensor layout, block size in bytes and host swapping."""

from __future__ import annotations

import os

import pytest
import torch

from sluice.cpu import resident_bytes
from sluice.kvcache.kv_tensors import KVTensors, kv_block_bytes


def make(num_blocks=8, num_host_blocks=6, dtype=torch.float32):
    return KVTensors(num_blocks, num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype=dtype,
                     device="cpu", num_host_blocks=num_host_blocks)


def test_layout_and_per_layer_views():
    kv = make()
    assert kv.kv.shape == (2, 3, 8, 4, 2, 4)
    assert kv.host_kv.shape == (2, 3, 6, 4, 2, 4)
    key_cache, value_cache = kv.layers[1]
    assert key_cache.shape == (8, 4, 2, 4)
    key_cache[5, 2] = 7.0  # views share storage with the big tensor
    assert kv.kv[0, 1, 5, 2].eq(7.0).all() and kv.kv[1].eq(0).all()
    assert kv.num_bytes == 8 * kv_block_bytes(3, 2, 4, 4, torch.float32)


def test_block_bytes():
    assert kv_block_bytes(30, 3, 64, 16, torch.bfloat16) == 2 * 30 * 16 * 3 * 64 * 2
    assert kv_block_bytes(30, 3, 64, 16, torch.float32) == 2 * kv_block_bytes(30, 3, 64, 16, torch.bfloat16)


def test_swap_out_then_in_restores_every_layer():
    kv = make()
    torch.manual_seed(0)
    kv.kv.copy_(torch.randn_like(kv.kv))
    original = kv.kv.clone()
    kv.swap_out([(1, 4), (6, 0), (3, 2)])
    assert torch.equal(kv.host_kv[:, :, 4], original[:, :, 1])
    assert torch.equal(kv.host_kv[:, :, 0], original[:, :, 6])
    kv.kv.zero_()  # the device blocks get reused by someone else
    kv.swap_in([(4, 7), (0, 0), (2, 3)])  # back into different device blocks, in a different order
    assert torch.equal(kv.kv[:, :, 7], original[:, :, 1])
    assert torch.equal(kv.kv[:, :, 0], original[:, :, 6])
    assert torch.equal(kv.kv[:, :, 3], original[:, :, 3])
    assert kv.kv[:, :, [1, 2, 4, 5, 6]].eq(0).all()  # nothing else touched


def test_empty_swaps_and_no_host_pool():
    kv = make(num_host_blocks=0)
    kv.swap_in([])
    kv.swap_out([])
    assert kv.host_num_bytes == 0


def test_bfloat16_roundtrip_is_exact():
    kv = make(dtype=torch.bfloat16)
    kv.kv.copy_(torch.randn(kv.kv.shape))
    block = kv.kv[:, :, 2].clone()
    kv.swap_out([(2, 5)])
    kv.swap_in([(5, 0)])
    assert torch.equal(kv.kv[:, :, 0], block)


def _rss_mib() -> float:
    return resident_bytes() / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_cpu_kv_pages_become_resident_as_blocks_are_written_not_at_start():
    """1 GiB of configured KV holds almost nothing resident until blocks are written; written blocks read back, the
    others read zeros."""
    before = _rss_mib()
    kv = KVTensors(4096, num_layers=8, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.float32, device="cpu",
                   num_host_blocks=1024)
    assert kv.num_bytes == 1 << 30
    assert _rss_mib() - before < 32
    kv.kv[:, :, :64] = 1.0  # 64 blocks of every layer: 16 MiB
    grown = _rss_mib() - before
    assert 15 < grown < 64, grown
    assert kv.kv[:, :, :64].min() == 1.0 and not kv.kv[:, :, 64:128].any() and not kv.host_kv[:, :, :8].any()
