"""Paged attention against a dense float64 reference, per sequence, for mixed prefill/decode batches."""

from __future__ import annotations

import platform
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sluice import native
from sluice.service.attention import decode_kernel as cpu_kernel
from sluice.service.attention.paged_attention import KERNEL_ROWS_MAX, AttentionMetadata, paged_attention
from sluice.service.bench.gpu_attention import paged_attention_case
from tests.support.attention import MIXES, run_case
from tests.support.kernels import MARCHES, build_variant, has_avx2


def decode_kernel():
    kernel = cpu_kernel.load()
    if kernel is None:
        pytest.skip("the native extension cannot be built here (no C++ compiler?)")
    return kernel


# (queries' dtype, cache's dtype): one type, and a bfloat16 cache under float32 queries (--kv-cache-dtype bfloat16)
DTYPE_PAIRS = [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.bfloat16),
               (torch.float32, torch.float16)]
DTYPE_IDS = ["float32", "bfloat16", "float32-bf16-cache", "float32-f16-cache"]


class VariantOps:
    """The extension interface DecodeKernel reads (paged_decode_isa, PagedDecodePlan(...).step), over a build of
    the kernel alone as torch ops: a TORCH_LIBRARY binding skips torch/extension.h and pybind11 (half the compile),
    and a plan is rebuilt each step (cheap beside the attention)."""

    def __init__(self, lib, path: str) -> None:
        self.lib, self.__file__ = lib, path

    def paged_decode_isa(self) -> str:
        return self.lib.paged_decode_isa()

    def PagedDecodePlan(self, *plan):  # noqa: N802 (the extension's class name)
        lib = self.lib
        return SimpleNamespace(step=lambda *args: lib.plan_step(*plan, *args))


def decode_variant(isa: str) -> cpu_kernel.DecodeKernel:
    """The decode kernel alone, built for `isa` (a key of MARCHES) on any x86-64 CPU that runs it."""
    if native.load() is None:
        pytest.skip("the native extension cannot be built here (no C++ compiler?)")
    binding = ('#include <torch/library.h>\n#include "cpu_ops.h"\n'
               'static at::Tensor plan_step(at::Tensor block_tables, at::Tensor seq_lens, '
               'std::optional<at::Tensor> slots, int64_t heads, int64_t kv_heads, int64_t head_dim, '
               'int64_t block_size, double scale, int64_t threads, const at::Tensor& query, '
               'const std::optional<at::Tensor>& key, const std::optional<at::Tensor>& value, at::Tensor key_cache, '
               'at::Tensor value_cache) {\n  return PagedDecodePlan(block_tables, seq_lens, slots, heads, kv_heads, '
               'head_dim, block_size, scale, threads).step(query, key, value, key_cache, value_cache);\n}\n'
               f'TORCH_LIBRARY(sluice_test_paged_{isa}, m) {{ m.def("paged_decode_isa", &paged_decode_isa); '
               'm.def("plan_step", &plan_step); }\n')
    # built once per machine, like the extension itself (tests/support/kernels.py)
    build_variant(f"paged_decode_{isa}", ["paged_decode.cpp"], binding, ["-O3", MARCHES[isa], *native.OPENMP_FLAGS],
                  python_module=False)
    kernel = cpu_kernel.DecodeKernel(VariantOps(getattr(torch.ops, f"sluice_test_paged_{isa}"), f"paged_decode_{isa}"))
    assert kernel.isa == isa
    return kernel


@pytest.fixture(scope="module")
def avx2_kernel():
    """Built for x86-64-v3 (what a Zen 3 runs: AVX2, FMA, F16C) on any CPU that has AVX2 and FMA."""
    if not has_avx2():
        pytest.skip("no AVX2 and FMA on this CPU")
    return decode_variant("avx2")


@pytest.fixture(scope="module")
def portable_kernel():
    """Built for plain x86-64: the scalar loops, and the float16 conversions written out without F16C."""
    if platform.machine() != "x86_64":
        pytest.skip("an x86-64 build")
    return decode_variant("portable")


# Which rows the C kernel attends: none (torch), a verify step's few rows of a sequence (c_kernel), or every row,
# prompt chunks too (c_kernel_all: what the runner asks of it for Sluice's own model without sliding windows).
DECODES = {"torch": None, "c_kernel": KERNEL_ROWS_MAX, "c_kernel_all": 10**6}


def case_kernel(decodes: str) -> dict:
    """run_case's kernel arguments for one entry of DECODES."""
    rows = DECODES[decodes]
    return {} if rows is None else {"kernel": decode_kernel(), "kernel_rows_max": rows}


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("decodes", list(DECODES))
def test_matches_dense_reference(block_size, mix, heads, decodes):
    err, _ = run_case(MIXES[mix], block_size, num_heads=heads[0], num_kv_heads=heads[1], **case_kernel(decodes))
    assert err < 1e-4


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("decodes", list(DECODES))
def test_float32_queries_over_a_16_bit_cache_match_the_rounded_reference(block_size, mix, decodes, kv_dtype):
    """--kv-cache-dtype under a float32 model: K/V rounded where they are stored (a prefill's own new keys too),
    everything else float32, so the reference on the rounded K/V is met to float32's precision."""
    err, out = run_case(MIXES[mix], block_size, kv_dtype=kv_dtype, **case_kernel(decodes))
    assert out.dtype == torch.float32 and err < 1e-4


def test_every_row_on_the_kernel_leaves_no_prefill_for_sdpa():
    kernel = decode_kernel()
    seqs = MIXES["mixed"]
    args = paged_attention_case(seqs, 4, torch.device("cpu"), torch.float32, 0, None, None, 8, 2, 16, None)[5]
    meta = AttentionMetadata.build(*args, kernel, kernel_rows_max=10**6)
    assert not meta.prefills and meta.decode.num_rows == sum(q for _, q in seqs)
    # row j of a chunk of q rows over a context of c tokens sees c + j + 1 of them
    assert meta.decode.seq_lens.tolist()[1:18] == list(range(1, 18))
    assert [p.q_len for p in AttentionMetadata.build(*args, kernel).prefills] == []  # 17 rows: KERNEL_ROWS_MAX
    assert [p.q_len for p in AttentionMetadata.build(*args, kernel, kernel_rows_max=8).prefills] == [17, 9]


# Edge values of the 16-bit types: ties, the largest finite halves and what rounds past them, half's subnormals
# and what underflows, signed zeros, infinities and NaN.
EDGES = [0.0, -0.0, 1.0, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 65504.0, 65519.0, 65520.0,
         -7e4, 6.1e-5, 2**-24, 1.5 * 2**-24, 2**-25, 2**-26, -3e-6, 1e-8, 3.0e38, float("inf"), float("-inf"),
         float("nan")]


@pytest.mark.deep  # slow (builds or a long end-to-end run): `make test-deep`
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("isa", ["native", "portable"])
def test_the_kernel_rounds_stored_keys_as_torch_does(isa, kv_dtype, request):
    """A decode step that stores its own K/V converts float32 to the cache's type bit for bit as torch's cast."""
    kernel = decode_kernel() if isa == "native" else request.getfixturevalue("portable_kernel")
    n, heads, head_dim = 4, 2, 16
    values = torch.tensor(EDGES * (n * heads * head_dim // len(EDGES) + 1))[: n * heads * head_dim]
    key = values.view(n, heads, head_dim)
    value = -key.flip(0)
    key_cache = torch.zeros(n, 1, heads, head_dim, dtype=kv_dtype)
    value_cache = torch.zeros_like(key_cache)
    tables, lens, slots = torch.arange(n).view(n, 1), torch.ones(n, dtype=torch.long), torch.arange(n)
    plan = kernel.plan(torch.zeros(n, heads, head_dim), key_cache, tables, lens, slots, 0.25)
    kernel.decode_step(plan, torch.zeros(n, heads, head_dim), key, value, key_cache, value_cache)
    for stored, given in ((key_cache, key), (value_cache, value)):
        want = given.to(kv_dtype).view(torch.int16)
        got = stored.view(n, heads, head_dim).view(torch.int16)
        nan = torch.isnan(given)
        assert torch.equal(got[~nan], want[~nan])
        assert torch.isnan(stored.view(n, heads, head_dim)[nan]).all()


# (query heads, KV heads, head dim): the kernel's specialised shapes (D 64/128 with 1-4 heads per group), its
# generic AVX-512 loop (D 32 with 8 per group, D 16), and shapes only its portable loop takes (D 80; 9 per group).
@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 4, 128), (4, 4, 64), (16, 2, 32), (2, 1, 16), (4, 4, 80),
                                   (18, 2, 64)])
@pytest.mark.parametrize("dtype,kv_dtype", DTYPE_PAIRS, ids=DTYPE_IDS)
def test_c_kernel_matches_torch_across_head_shapes(shape, dtype, kv_dtype):
    kernel = decode_kernel()
    heads, kv_heads, head_dim = shape
    rng = random.Random(sum(shape))
    seqs = [(rng.randrange(0, 90), 1) for _ in range(6)] + [(0, 1), (15, 1), (16, 1), (17, 1)]
    err_c, out_c = run_case(seqs, 16, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                            kernel=kernel, kv_dtype=kv_dtype)
    err_t, out_t = run_case(seqs, 16, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                            kv_dtype=kv_dtype)
    if dtype == torch.float32:
        assert err_c < 1e-4 and err_t < 1e-4
        torch.testing.assert_close(out_c, out_t, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out_c.float(), out_t.float(), rtol=2**-7, atol=2e-2)


@pytest.mark.deep  # slow (builds or a long end-to-end run): `make test-deep`
@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 4, 128), (16, 2, 32), (2, 1, 16), (4, 4, 80), (4, 2, 256)])
@pytest.mark.parametrize("dtype,kv_dtype", DTYPE_PAIRS, ids=DTYPE_IDS)
def test_avx2_build_matches_torch(shape, dtype, kv_dtype, avx2_kernel):
    """The AVX2 path (what a Zen 3 runs), built for x86-64-v3 on any CPU that has AVX2; D 80 takes the portable loop."""
    kernel = avx2_kernel
    assert kernel.isa == "avx2"
    heads, kv_heads, head_dim = shape
    rng = random.Random(sum(shape))
    seqs = [(rng.randrange(0, 90), 1) for _ in range(6)] + [(0, 1), (7, 1), (8, 1), (16, 1)]
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, kv_dtype=kv_dtype)
    _, out_c = run_case(seqs, 16, kernel=kernel, **kw)
    err_t, out_t = run_case(seqs, 16, **kw)
    if dtype == torch.float32:
        torch.testing.assert_close(out_c, out_t, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out_c.float(), out_t.float(), rtol=2**-7, atol=2e-2)


@pytest.mark.parametrize("dtype,kv_dtype", DTYPE_PAIRS, ids=DTYPE_IDS)
def test_portable_build_matches_torch(dtype, kv_dtype, portable_kernel):
    """The scalar loops every other CPU runs (a grouped and an uneven head shape)."""
    for heads, kv_heads, head_dim in [(9, 3, 64), (4, 4, 80)]:
        seqs = [(37, 1), (0, 1), (16, 1), (70, 1)]
        kw = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, kv_dtype=kv_dtype)
        _, out_c = run_case(seqs, 16, kernel=portable_kernel, **kw)
        _, out_t = run_case(seqs, 16, **kw)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2e-2)
        torch.testing.assert_close(out_c.float(), out_t.float(), **tol)


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


@pytest.mark.parametrize("lengths", [[600, 41, 333, 5, 129, 64, 600, 17, 250, 99], [600], [520, 3, 300]],
                         ids=["all-heads", "one-sequence", "uneven-spans"])
def test_one_row_walks_many_heads_in_chunks_and_matches_torch(lengths):
    """A decode row's work item takes several KV heads (all of them where sequences are many, a share where they are
    few, the last share smaller), over chunks of tokens: 16 KV heads of float16 rows make a chunk 64 tokens."""
    kernel = decode_kernel()
    kw = dict(num_heads=32, num_kv_heads=16, head_dim=64, dtype=torch.float32, kv_dtype=torch.float16)
    seqs = [(n - 1, 1) for n in lengths]
    err_c, out_c = run_case(seqs, 16, kernel=kernel, **kw)
    err_t, out_t = run_case(seqs, 16, **kw)
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


def test_a_cache_of_another_dtype_resolves_to_the_torch_backend():
    """FlexAttention and flash-attn read the cache in place in the queries' dtype: 'auto' picks the torch path for
    a bfloat16 cache under float32 queries, and an explicit other choice is refused with the flags that fix it."""
    from sluice.service.attention.paged_attention import resolve_backend

    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, 16, mixed_dtypes=True) == "torch"
    for name in ("flex", "flash"):
        with pytest.raises(ValueError, match="--kv-cache-dtype auto"):
            resolve_backend(name, cpu, 16, mixed_dtypes=True)


def test_a_few_rows_of_one_sequence_are_decodes_for_the_kernel():
    """A verify step's 1 + d rows (and a chunk's short tail) run on the C kernel, row j seeing the cache up to its
    own position; longer chunks, and every chunk without the kernel, take the prefill path."""
    kernel = decode_kernel()
    tables = torch.arange(80, dtype=torch.int32).view(2, 40)
    slots = torch.arange(5 + KERNEL_ROWS_MAX + 1)
    meta = AttentionMetadata.build([5, KERNEL_ROWS_MAX + 1], [600, 300], tables, slots, 16, kernel)
    assert meta.decode.num_rows == 5 and meta.decode.rows == slice(0, 5)
    assert meta.decode.seq_lens.tolist() == [596, 597, 598, 599, 600]
    assert [(p.start, p.q_len) for p in meta.prefills] == [(5, KERNEL_ROWS_MAX + 1)]
    plain = AttentionMetadata.build([5, KERNEL_ROWS_MAX + 1], [600, 300], tables, slots, 16, None)
    assert plain.decode is None and len(plain.prefills) == 2
    err, _ = run_case([(600, 5), (0, 3), (37, 1)], 16, num_heads=9, num_kv_heads=3, head_dim=64, kernel=kernel)
    assert err < 1e-4


def _attend(kernel, q, kc, vc, tables, lens):
    return kernel.decode_step(kernel.plan(q, kc, tables, lens, None, q.shape[-1] ** -0.5), q, None, None, kc, vc)


@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 32, 64), (8, 2, 128), (4, 4, 96), (16, 2, 64)])
def test_a_sequences_rows_attended_together_are_each_row_alone_bit_for_bit(isa, shape, request):
    """A verify step's rows (one table, each one token longer) are one work item: each K and V row is read once for
    all of them, and every row's output is the bits it gets as a decode of its own, so greedy output with n-gram
    speculation is the output without it. Rows of another sequence that happen to be one token longer stay apart."""
    kernel = decode_kernel() if isa == "native" else request.getfixturevalue(f"{isa}_kernel")
    heads, kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(sum(shape))
    for cache_dtype, q_dtype in [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                 (torch.bfloat16, torch.bfloat16)]:
        kc, vc = (torch.randn(120, 16, kv_heads, head_dim, generator=gen).to(cache_dtype) for _ in range(2))
        for length, rows in [(5, 5), (37, 2), (300, 5), (300, 17)]:
            table = torch.randperm(120, generator=gen)[: -(-length // 16)].long()
            other = torch.randperm(120, generator=gen)[: -(-(length + 1) // 16)].long()
            tables = torch.zeros(rows + 1, other.numel(), dtype=torch.long)
            tables[:rows, : table.numel()] = table
            tables[rows] = other
            lens = torch.tensor([length - rows + 1 + j for j in range(rows)] + [length + 1])
            q = torch.randn(rows + 1, heads, head_dim, generator=gen).to(q_dtype)
            together = _attend(kernel, q, kc, vc, tables, lens)
            alone = torch.cat([_attend(kernel, q[j:j + 1], kc, vc, tables[j:j + 1], lens[j:j + 1])
                               for j in range(rows + 1)])
            assert torch.equal(together, alone), (cache_dtype, length, rows)
            reference = [torch.softmax(q[j].float().view(kv_heads, -1, head_dim) @ _gathered(kc, tables[j], lens[j])
                                       .transpose(-1, -2) / head_dim ** 0.5, -1) @ _gathered(vc, tables[j], lens[j])
                         for j in range(rows + 1)]
            tol = dict(atol=1e-4, rtol=1e-4) if q_dtype == torch.float32 else dict(atol=2e-2, rtol=2**-7)
            torch.testing.assert_close(together.float(), torch.stack(reference).view_as(together), **tol)


def _gathered(cache, table, length):
    """One sequence's first `length` K or V rows, float [Hkv, length, D]."""
    return cache[table].flatten(0, 1)[:length].float().transpose(0, 1)
