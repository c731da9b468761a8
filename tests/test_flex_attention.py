"""FlexAttention paged attention (kvcache/flex_attention.py) against the dense float64 reference of
test_paged_attention, on CPU: flex_attention's unfused reference path there, the same block masks as on CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from sluice.kvcache import flex_attention as flex
from sluice.kvcache.paged_attention import AttentionMetadata, resolve_backend
from tests.test_paged_attention import MIXES, run_case

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
    assert mask.kv_num_blocks[:, 0, 0].tolist() == [2, 3, 1]
    assert [mask.kv_indices[b, 0, 0, :n].tolist() for b, n in enumerate([2, 3, 1])] == [[5, 2], [1, 3, 6], [4]]
    assert decodes.logical[0].tolist() == [-1, -1, 1, -1, -1, 0, -1, -1]  # padding (block 0) is not owned
    assert mask.shape[-2:] == (1, 8 * 4)  # queries x the whole physical cache


def test_resolve_backend():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("auto", cpu, 16) == "torch"
    assert resolve_backend("auto", cuda, 16) == "flex"
    assert resolve_backend("auto", cuda, 4) == "torch"  # too small a tile for Triton
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
    """The engine end to end on flex (chunked prefill over cached context, prefix hits, preemption)."""
    from sluice.scheduling.sampling_params import SamplingParams
    from tests.test_parity import make_engine, reference_case

    ours, prompts, expected = reference_case("llama")
    engine = make_engine(ours, "recompute", num_blocks=24)
    engine.runner.attention_backend = "flex"
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
