"""Paged attention against a dense float64 reference, per sequence, for mixed prefill/decode batches."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from sluice import native
from sluice.kvcache import decode_kernel as cpu_kernel
from sluice.kvcache.paged_attention import AttentionMetadata, paged_attention
from tests.support.attention import MIXES, run_case
from tests.support.kernels import build_variant, has_avx2


def decode_kernel():
    kernel = cpu_kernel.load()
    if kernel is None:
        pytest.skip("the native extension cannot be built here (no C++ compiler?)")
    return kernel


@pytest.fixture(scope="module")
def avx2_kernel():
    """The decode kernel alone, built for x86-64-v3 (what a Zen 3 runs) on any CPU that has AVX2 and FMA; its class
    module-local, as the process's own extension has registered PagedDecodePlan already."""
    if not has_avx2():
        pytest.skip("no AVX2 and FMA on this CPU")
    if native.load() is None:
        pytest.skip("the native extension cannot be built here (no C++ compiler?)")
    binding = ('#include <torch/extension.h>\n#include "cpu_ops.h"\n'
               'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode_isa", &paged_decode_isa);\n'
               'pybind11::class_<PagedDecodePlan>(m, "PagedDecodePlan", pybind11::module_local()).def(pybind11::init<torch::Tensor, '
               'torch::Tensor, c10::optional<torch::Tensor>, int64_t, int64_t, int64_t, int64_t, double, '
               'int64_t>()).def("step", &PagedDecodePlan::step); }\n')
    # built once per machine, like the extension itself (tests/support/kernels.py)
    ops = build_variant("paged_decode_avx2", ["paged_decode.cpp"], binding,
                        ["-O3", "-march=x86-64-v3", *native.OPENMP_FLAGS])
    return cpu_kernel.DecodeKernel(ops)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("decodes", ["torch", "c_kernel"])
def test_matches_dense_reference(block_size, mix, heads, decodes):
    kernel = decode_kernel() if decodes == "c_kernel" else None
    err, _ = run_case(MIXES[mix], block_size, num_heads=heads[0], num_kv_heads=heads[1], kernel=kernel)
    assert err < 1e-4


# (query heads, KV heads, head dim): the kernel's specialised shapes (D 64/128 with 1-4 heads per group), its
# generic AVX-512 loop (D 32 with 8 per group, D 16), and shapes only its portable loop takes (D 80; 9 per group).
@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 4, 128), (4, 4, 64), (16, 2, 32), (2, 1, 16), (4, 4, 80),
                                   (18, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_kernel_matches_torch_across_head_shapes(shape, dtype):
    kernel = decode_kernel()
    heads, kv_heads, head_dim = shape
    rng = random.Random(sum(shape))
    seqs = [(rng.randrange(0, 90), 1) for _ in range(6)] + [(0, 1), (15, 1), (16, 1), (17, 1)]
    err_c, out_c = run_case(seqs, 16, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                            kernel=kernel)
    err_t, out_t = run_case(seqs, 16, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    if dtype == torch.float32:
        assert err_c < 1e-4 and err_t < 1e-4
        torch.testing.assert_close(out_c, out_t, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out_c.float(), out_t.float(), rtol=2**-7, atol=2e-2)


@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 4, 128), (16, 2, 32), (2, 1, 16), (4, 4, 80), (4, 2, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_build_matches_torch(shape, dtype, avx2_kernel):
    """The AVX2 path (what a Zen 3 runs), built for x86-64-v3 on any CPU that has AVX2; D 80 takes the portable loop."""
    kernel = avx2_kernel
    assert kernel.isa == "avx2"
    heads, kv_heads, head_dim = shape
    rng = random.Random(sum(shape))
    seqs = [(rng.randrange(0, 90), 1) for _ in range(6)] + [(0, 1), (7, 1), (8, 1), (16, 1)]
    _, out_c = run_case(seqs, 16, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, kernel=kernel)
    err_t, out_t = run_case(seqs, 16, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(out_c, out_t, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out_c.float(), out_t.float(), rtol=2**-7, atol=2e-2)


@pytest.mark.parametrize("mix", ["decodes", "mixed"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_c_kernel_reads_a_bf16_cache(mix, block_size):
    kernel = decode_kernel()
    err_c, out_c = run_case(MIXES[mix], block_size, dtype=torch.bfloat16, kernel=kernel)
    err_t, out_t = run_case(MIXES[mix], block_size, dtype=torch.bfloat16)
    assert out_c.dtype == torch.bfloat16
    # the reference runs on the same bf16-rounded inputs: what is left is float32 sums and one bf16 rounding
    assert err_c < 2e-2 and err_t < 2e-2
    torch.testing.assert_close(out_c.float(), out_t.float(), rtol=2**-7, atol=2e-2)


def test_c_kernel_spreads_a_large_batch_over_threads_and_matches_torch():
    kernel = decode_kernel()
    rng = random.Random(5)
    seqs = [(rng.randrange(0, 300), 1) for _ in range(48)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)  # three OpenMP threads sharing sequences of uneven lengths
        err_c, out_c = run_case(seqs, 16, num_heads=9, num_kv_heads=3, head_dim=64, kernel=kernel)
    finally:
        torch.set_num_threads(threads)
    err_t, out_t = run_case(seqs, 16, num_heads=9, num_kv_heads=3, head_dim=64)
    assert err_c < 1e-4 and err_t < 1e-4
    torch.testing.assert_close(out_c, out_t, atol=1e-5, rtol=1e-5)


def test_decode_only_step_plans_once_for_every_layer():
    """Layers of one decode-only step share the kernel's plan; each stores its own K/V and attends its own cache."""
    kernel = decode_kernel()
    torch.manual_seed(3)
    block_size, lens = 4, [9, 3, 12]
    tables = torch.tensor([[5, 1, 7], [2, 0, 0], [3, 4, 6]], dtype=torch.int32)
    slots = torch.tensor([tables[i, (n - 1) // block_size] * block_size + (n - 1) % block_size
                          for i, n in enumerate(lens)], dtype=torch.long)
    meta = AttentionMetadata.build([1, 1, 1], lens, tables, slots, block_size, kernel)
    torch_meta = AttentionMetadata.build([1, 1, 1], lens, tables, slots, block_size)
    for _layer in range(3):
        caches = [torch.randn(8, block_size, 2, 16) for _ in range(2)]
        q, k, v = torch.randn(3, 6, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
        want = paged_attention(q, k, v, *(c.clone() for c in caches), torch_meta)
        got = paged_attention(q, k, v, *caches, meta)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(caches[0].view(-1, 2, 16)[slots], k) and torch.equal(caches[1].view(-1, 2, 16)[slots], v)
    assert len(meta.decode.plans) == 1


def test_c_kernel_is_built_with_openmp_when_torch_uses_it():
    # Built without -fopenmp, its pragmas are ignored: right answers on one core, which nothing else would notice.
    kernel = decode_kernel()
    if not torch.backends.openmp.is_available():
        pytest.skip("torch built without OpenMP")
    assert b"libgomp" in Path(kernel.path).read_bytes()


@pytest.mark.parametrize("mix", ["mixed", "chunk_with_context", "prefill_only"])
@pytest.mark.parametrize("window", [1, 8])
def test_sliding_window(mix, window):
    err, _ = run_case(MIXES[mix], 4, window=window)
    assert err < 1e-4
    err, _ = run_case(MIXES[mix], 4, window=window, kernel=decode_kernel())  # the kernel defers to torch here
    assert err < 1e-4


@pytest.mark.parametrize("mix", ["mixed", "decodes"])
def test_softcap(mix):
    err, _ = run_case(MIXES[mix], 16, softcap=5.0)
    assert err < 1e-4


@pytest.mark.parametrize("seed", range(6))
def test_random_mixes(seed):
    rng = random.Random(seed)
    seqs = []
    for _ in range(rng.randrange(1, 9)):
        kind = rng.choice(["decode", "prefill", "chunk"])
        if kind == "decode":
            seqs.append((rng.randrange(0, 80), 1))
        elif kind == "prefill":
            seqs.append((0, rng.randrange(2, 40)))
        else:
            seqs.append((rng.randrange(1, 60), rng.randrange(2, 30)))
    err, _ = run_case(seqs, rng.choice([1, 2, 16]), seed=seed)
    assert err < 1e-4


def test_bfloat16_close_to_reference():
    err, out = run_case(MIXES["mixed"], 16, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and err < 5e-2


def test_kernel_lives_in_the_cache_dir_and_is_none_without_a_compiler(tmp_path, monkeypatch):
    kernel = decode_kernel()
    assert Path(kernel.path).is_relative_to(native.cache_dir())
    # Loading it must leave the process's floating-point state alone (no flush-to-zero from -ffast-math).
    assert (torch.tensor([1e-39]) * 2).item() != 0.0
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert native.load.__wrapped__() is None  # the torch path then runs


def test_a_plan_refuses_lengths_past_its_block_table():
    kernel = decode_kernel()
    q, cache = torch.randn(1, 4, 16), torch.randn(4, 4, 2, 16)
    tables, slots = torch.tensor([[0, 1]]), torch.tensor([5])
    with pytest.raises(RuntimeError, match="outside 1..8"):
        kernel.plan(q, cache, tables, torch.tensor([9]), slots, 0.25)
    with pytest.raises(RuntimeError, match="int64"):
        kernel.plan(q, cache, tables.int(), torch.tensor([3]), slots, 0.25)
    plan = kernel.plan(q, cache, tables, torch.tensor([3]), slots, 0.25)
    with pytest.raises(RuntimeError, match="slots"):  # a plan with slots stores new K/V: it needs them
        kernel.decode_step(plan, q, None, None, cache, cache.clone())
