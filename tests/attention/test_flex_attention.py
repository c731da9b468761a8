"""FlexAttention paged attention (service/attention/flex_attention.py) against the dense float64 reference of
test_paged_attention, on CPU: flex_attention's unfused reference path there, the same block masks as on CUDA."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from sluice.service.attention import flex_attention as flex
from sluice.service.attention.paged_attention import AttentionMetadata, resolve_backend
from tests.support.attention import MIXES, run_case

pytestmark = pytest.mark.skipif(flex.flex_attention is None, reason="torch without flex_attention")


@pytest.fixture
def use_flex(monkeypatch):
    build = AttentionMetadata.build.__func__
    built = []

    def flex_build(cls, *args, **kwargs):
        kwargs.pop("backend", None)
        meta = build(cls, *args, backend="flex", **kwargs)
        built.append(meta)
        return meta

    monkeypatch.setattr(AttentionMetadata, "build", classmethod(flex_build))
    return built


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
def test_matches_dense_reference(use_flex, block_size, mix, heads):
    err, _ = run_case(MIXES[mix], block_size, num_heads=heads[0], num_kv_heads=heads[1])
    assert err < 1e-4
    assert use_flex[-1].backend == "flex" and use_flex[-1].decode is None and use_flex[-1].flex_groups


@pytest.mark.parametrize("mix", ["mixed", "chunk_with_context", "prefill_only"])
@pytest.mark.parametrize("window", [1, 8])
def test_sliding_window(use_flex, mix, window):
    err, _ = run_case(MIXES[mix], 4, window=window)
    assert err < 1e-4


@pytest.mark.parametrize("mix", ["mixed", "decodes"])
def test_softcap(use_flex, mix):
    err, _ = run_case(MIXES[mix], 16, softcap=5.0)
    assert err < 1e-4


@pytest.mark.parametrize("seed", range(4))
def test_random_mixes(use_flex, seed):
    rng = random.Random(seed)
    seqs = [(rng.randrange(0, 60), rng.choice([1, 1, rng.randrange(2, 30)])) for _ in range(rng.randrange(1, 8))]
    err, _ = run_case(seqs, rng.choice([1, 2, 16]), seed=seed)
    assert err < 1e-4


def test_bfloat16_close_to_reference(use_flex):
    err, out = run_case(MIXES["mixed"], 16, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and err < 5e-2


def test_groups_and_block_masks_list_each_sequences_own_blocks():
    """Decodes share one call, each prefill has its own; every row's mask visits exactly its table's blocks."""
    tables = torch.tensor([[5, 2, 0], [7, 0, 0], [1, 3, 6], [4, 0, 0]], dtype=torch.int32)
    query_lens, seq_lens = [1, 9, 1, 1], [5, 9, 11, 2]
    cu_q = [0, 1, 10, 11, 12]
    groups = flex.plan_groups(query_lens, seq_lens, cu_q, tables, 4)
    assert [(g.num_seqs, g.q_len) for g in groups] == [(3, 1), (1, 9)]
    decodes, prefill = groups
    assert decodes.rows.tolist() == [0, 10, 11] and prefill.rows == slice(1, 10)
    assert decodes.num_blocks == [2, 3, 1] and decodes.q_start.tolist() == [4, 10, 1]
    mask = flex.build_block_mask(decodes, 8, 4, None)
    # Queries at positions 4, 10 and 1: blocks wholly before them are full, the one holding them partial.
    assert mask.kv_num_blocks[:, 0, 0].tolist() == [1, 1, 1]
    assert [mask.kv_indices[b, 0, 0, :1].tolist() for b in range(3)] == [[2], [6], [4]]
    assert mask.full_kv_num_blocks[:, 0, 0].tolist() == [1, 2, 0]
    assert [mask.full_kv_indices[b, 0, 0, :n].tolist() for b, n in enumerate([1, 2, 0])] == [[5], [1, 3], []]
    assert decodes.logical[0].tolist() == [-1, -1, 1, -1, -1, 0, -1, -1]  # padding (block 0) is not owned
    assert mask.shape[-2:] == (1, 8 * 4)  # queries x the whole physical cache


def test_resolve_backend():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("auto", cpu, 16) == "torch"
    # Sluice's Triton kernels read any block size; flex needs a block to be a whole Triton tile.
    has_triton = importlib.util.find_spec("triton") is not None
    assert resolve_backend("auto", cuda, 16) == ("triton" if has_triton else "flex")
    assert resolve_backend("auto", cuda, 4) == ("triton" if has_triton else "torch")
    assert resolve_backend("flex", cpu, 4) == "flex"
    assert resolve_backend("torch", cuda, 16) == "torch"
    with pytest.raises(ValueError):
        resolve_backend("flex", cuda, 8)
    with pytest.raises(ValueError):
        resolve_backend("nope", cpu, 16)
    if flex.flex_attention is not None:
        with pytest.raises(ValueError):
            resolve_backend("flash", cpu, 256)


def test_greedy_parity_with_generate_on_the_flex_backend():
    """The engine end to end on flex, chosen by --attention-backend (chunked prefill over cached context, prefix
    hits, preemption)."""
    from sluice.scheduling.sampling_params import SamplingParams
    from sluice.service.cli import build_parser
    from sluice.service.config import config_from_args
    from sluice.service.engine.engine import LLMEngine
    from tests.support import tiny
    from tests.support.parity import reference_case

    cfg = config_from_args(build_parser().parse_args(
        ["serve", "--attention-backend", "flex", "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "24",
         "--max-num-batched-tokens", "64", "--max-num-seqs", "16"]))
    assert cfg.cache.attention_backend == "flex"
    ours, prompts, expected = reference_case("llama")
    engine = LLMEngine(cfg, model=ours, tokenizer=tiny.tokenizer())
    assert engine.runner.attention_backend == "flex"
    calls = []
    real = flex.flex_paged_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    flex.flex_paged_attention = spy
    try:
        results = engine.generate(prompts[:8], SamplingParams(max_tokens=12, temperature=0.0))
    finally:
        flex.flex_paged_attention = real
    assert calls
    for got, want in zip(results, expected[:8], strict=True):
        assert got.token_ids == want[:12]


def test_an_explicit_backend_this_device_cannot_run_fails_at_start():
    from sluice.kvcache.config import CacheConfig
    from sluice.service.executor.model_runner import ModelRunner
    from tests.support.parity import build_pair

    _, model = build_pair("llama")
    with pytest.raises(ValueError, match="flash"):
        ModelRunner(model, CacheConfig(num_kv_blocks=4, attention_backend="flash"), "cpu", torch.float32, 64, 4)


def visibility_from_block_mask(mask, group, num_physical: int, block_size: int) -> torch.Tensor:
    """[B, q_len, num_physical * block_size] as a block-sparse kernel reads the mask: full blocks wholly, partial
    blocks through mask_mod, unlisted blocks not at all (the unfused CPU path cannot tell these apart). Every query
    of a tile reads the tile's lists, so each list is applied to the tile's queries at once."""
    out = torch.zeros(group.num_seqs, group.q_len, num_physical * block_size, dtype=torch.bool)
    offsets = torch.arange(block_size)
    for b in range(group.num_seqs):
        for tile, first in enumerate(range(0, group.q_len, flex.Q_BLOCK)):
            q = torch.arange(first, min(first + flex.Q_BLOCK, group.q_len))[:, None]
            full = mask.full_kv_indices[b, 0, tile, : mask.full_kv_num_blocks[b, 0, tile]].tolist()
            partial = mask.kv_indices[b, 0, tile, : mask.kv_num_blocks[b, 0, tile]].tolist()
            assert len(set(full + partial)) == len(full) + len(partial), "a block listed twice"
            for blocks, is_full in ((full, True), (partial, False)):
                if blocks:
                    slots = (torch.tensor(blocks)[:, None] * block_size + offsets).reshape(1, -1)
                    out[b, q, slots] = True if is_full else mask.mask_mod(torch.tensor(b), torch.tensor(0), q, slots)
    return out


@pytest.mark.parametrize("window", [None, 3, 20, 150])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_block_masks_are_exact_where_the_kernel_skips_mask_mod(window, block_size):
    """Full blocks skip mask_mod in the compiled kernels: their lists must be exactly right (CPU, no kernel)."""
    rng = random.Random(block_size)
    seqs = [(rng.randrange(0, 200), 1) for _ in range(4)] + [(rng.randrange(0, 90), rng.randrange(2, 300))
                                                             for _ in range(2)] + [(0, 140)]
    blocks = [-(-(c + q) // block_size) for c, q in seqs]
    num_physical = sum(blocks) + 3
    free = list(range(num_physical))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks]
    width = max(blocks)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    query_lens, seq_lens = [q for _, q in seqs], [c + q for c, q in seqs]
    cu_q = [0]
    for n in query_lens:
        cu_q.append(cu_q[-1] + n)
    groups = flex.plan_groups(query_lens, seq_lens, cu_q, block_tables, block_size)
    order = [[i for i, q in enumerate(query_lens) if q == 1]] + [[i] for i, q in enumerate(query_lens) if q > 1]
    for group, members in zip(groups, order, strict=True):
        mask = flex.build_block_mask(group, num_physical, block_size, window)
        got = visibility_from_block_mask(mask, group, num_physical, block_size)
        for b, i in enumerate(members):
            # logical position j * block_size + o lives in physical slot tables[i][j] * block_size + o
            slots = (torch.tensor(tables[i])[:, None] * block_size + torch.arange(block_size)).reshape(-1)
            pos_k = torch.arange(len(slots))[None, :]
            pos_q = seq_lens[i] - group.q_len + torch.arange(group.q_len)[:, None]
            visible = (pos_k <= pos_q) & (pos_k > pos_q - window) if window is not None else pos_k <= pos_q
            expected = torch.zeros(group.q_len, num_physical * block_size, dtype=torch.bool)
            expected[:, slots] = visible
            assert torch.equal(got[b], expected), (i, seqs[i])


# --- CUDA kernel options, checked on CPU against Inductor's own default configs -----------------------------


@pytest.fixture
def gpu_capability(monkeypatch):
    """Inductor's CUDA config tables, read on CPU by faking the device capability they are keyed by."""
    from torch._inductor.choices import InductorChoices

    def use(capability):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        flex.kernel_options.cache_clear()
        return InductorChoices()

    yield use
    flex.kernel_options.cache_clear()


@pytest.mark.parametrize("capability", [(9, 0), (8, 0), (10, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_kernel_tiles_divide_the_block_mask_tiles(gpu_capability, capability, dtype, head_dim):
    """Inductor's check ("Q and KV block size must be divisible by BLOCK_M and BLOCK_N") for every block size."""
    choices = gpu_capability(capability)
    fwd = choices.get_flex_attention_fwd_configs(head_dim, dtype, "cuda")
    decode = choices.get_flex_decode_configs(head_dim, dtype, "cuda")
    for block_size in (16, 32, 64, 128, 256):
        for prefill in (True, False):
            options = flex.kernel_options(block_size, dtype, head_dim, prefill)
            assert options.get("FORCE_USE_FLEX_ATTENTION", False) == prefill  # prefill: never the decoding kernel
            for conf in fwd:
                block_n, block_m = options.get("BLOCK_N", conf.block_n), options.get("BLOCK_M", conf.block_m)
                assert block_size % block_n == 0 and flex.Q_BLOCK % block_m == 0
                assert block_n <= conf.block_n  # never a wider tile than Inductor's: no more shared memory
            for conf in decode:
                assert block_size % options["BLOCK_N"] == 0 and options["BLOCK_N"] <= conf.block_n


def test_h200_bf16_head_64_block_64_is_what_failed(gpu_capability):
    """Inductor's H100/H200 default for bf16, head_dim 64 is a 128 x 128 tile: block size 64 needs BLOCK_N 64."""
    (default,) = gpu_capability((9, 0)).get_flex_attention_fwd_configs(64, torch.bfloat16, "cuda")
    assert (default.block_m, default.block_n) == (128, 128) and 64 % default.block_n != 0
    tiles = {bs: flex.kernel_options(bs, torch.bfloat16, 64, True)["BLOCK_N"] for bs in (16, 32, 64, 128, 256)}
    assert tiles == {16: 16, 32: 32, 64: 64, 128: 64, 256: 64}  # 64: the decoding kernel's default tile


def test_kernel_options_fall_back_to_a_small_tile_when_inductor_cannot_say(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: 1 / 0)
    flex.kernel_options.cache_clear()
    try:
        assert {bs: flex.kernel_options(bs, torch.bfloat16, 64, False) for bs in (16, 64, 256)} == {
            16: {"BLOCK_N": 16}, 64: {"BLOCK_N": flex.FALLBACK_BLOCK_N}, 256: {"BLOCK_N": flex.FALLBACK_BLOCK_N}}
    finally:
        flex.kernel_options.cache_clear()
