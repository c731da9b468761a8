"""Batched sampling: support restrictions, seeded reproducibility, min_tokens and logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice import native
from sluice.scheduling.output import ScheduledRequest
from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.executor.sampler import greedy_ids, row_seed, sample
from tests.support.kernels import greedy_kernels, variant_isas

V = 50


def req(num_output_tokens=0, eos=None, pending=False, **params) -> ScheduledRequest:
    return ScheduledRequest(
        request_id="r", token_ids=[1], start_pos=0, block_ids=[0], sample=True,
        sampling_params=SamplingParams(**params), num_output_tokens=num_output_tokens,
        eos_token_id=eos, min_tokens_pending=pending,
    )


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    row = torch.full((V,), -1e9)
    row[: len(probs)] = torch.tensor(probs).log()
    return row


def draw_support(params: dict, probs: list[float], n: int = 2000) -> set[int]:
    logits = logits_from_probs(probs).repeat(n, 1)
    return set(sample(logits, [req(**params)] * n).token_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_ids_pick_the_first_maximum_as_argmax(dtype):
    torch.manual_seed(0)
    x = (torch.randn(64, 1031) * 0.05).round(decimals=1).to(dtype)  # values on a coarse grid: many ties
    x[3, 7] = float("nan")  # argmax counts NaN as the maximum
    x[4] = float("-inf")
    x[5] = 0.0
    assert torch.equal(greedy_ids(x), x.argmax(dim=-1))
    assert greedy_ids(x)[5] == 0 and greedy_ids(x)[3] == 7


@pytest.mark.deep  # slow (builds or a long end-to-end run): `make test-deep`
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 200), seed=st.integers(0, 2**16),
       specials=st.lists(st.sampled_from(["nan", "inf", "-inf", "tie"]), max_size=4))
def test_native_greedy_argmax_is_torchs_max_index(rows, vocab, seed, specials):
    # The first largest value, or the first NaN, in rows shorter and longer than a vector or two, with the
    # specials anywhere (in the first vector too, where the vector path must not start).
    kernel = native.load()
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=gen) * 0.05).round(decimals=1)  # a coarse grid: ties
    for special in specials:
        at = (int(torch.randint(rows, (), generator=gen)), int(torch.randint(vocab, (), generator=gen)))
        x[at] = x.max() if special == "tie" else float(special)
    want = x.max(dim=-1).indices
    assert torch.equal(kernel.greedy_argmax(x), want)
    for isa in variant_isas():  # the AVX2 lanes and the scalar loop pick the same
        assert torch.equal(greedy_kernels(isa).argmax(x), want), isa


def test_native_greedy_argmax_refuses_what_it_cannot_read():
    kernel = native.load()
    with pytest.raises(RuntimeError, match="float32"):
        kernel.greedy_argmax(torch.zeros(2, 5, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="float32"):
        kernel.greedy_argmax(torch.zeros(2, 0))
    assert kernel.greedy_argmax(torch.zeros(0, 5)).shape == (0,)


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(7, V)
    requests = [req(temperature=0.0), req(top_k=1, temperature=1.5)] * 3 + [req(temperature=0.0, seed=3)]
    assert sample(logits, requests).token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "params, support",
    [
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.7}, {0, 1}),
        ({"top_p": 0.8}, {0, 1}),  # the mass before token 2 is 0.8: not strictly below top_p
        ({"top_p": 0.81}, {0, 1, 2}),
        ({"min_p": 0.5}, {0, 1}),  # threshold 0.25
        ({"min_p": 0.2}, {0, 1, 2}),  # threshold 0.1
        ({"top_k": 3, "top_p": 0.99}, {0, 1, 2}),
        ({}, {0, 1, 2, 3}),
    ],
)
def test_filters_restrict_support(params, support):
    assert draw_support(params, [0.5, 0.3, 0.15, 0.05]) == support


def test_top_k_rows_differ_in_one_batch():
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1]).repeat(600, 1)
    requests = [req(top_k=1 + i % 3, temperature=1.0) for i in range(600)]
    tokens = sample(logits, requests).token_ids
    assert all(t < 1 + i % 3 for i, t in enumerate(tokens))
    assert {t for i, t in enumerate(tokens) if i % 3 == 2} == {0, 1, 2}


def test_frequencies_follow_the_distribution():
    probs = [0.5, 0.3, 0.15, 0.05]
    n = 20000
    tokens = torch.tensor(sample(logits_from_probs(probs).repeat(n, 1), [req()] * n).token_ids)
    freq = torch.bincount(tokens, minlength=4)[:4].float() / n
    assert torch.allclose(freq, torch.tensor(probs), atol=0.015)


def test_temperature_sharpens():
    probs = [0.6, 0.4]
    n = 8000
    tokens = torch.tensor(sample(logits_from_probs(probs).repeat(n, 1), [req(temperature=0.5)] * n).token_ids)
    expected = 0.6**2 / (0.6**2 + 0.4**2)  # p^(1/T), renormalised
    assert abs((tokens == 0).float().mean().item() - expected) < 0.02


def test_seeded_rows_are_reproducible_across_batches():
    torch.manual_seed(1)
    row = torch.randn(V)
    seeded = dict(seed=1234, temperature=1.0, top_p=0.9)
    alone = [sample(row[None], [req(num_output_tokens=k, **seeded)]).token_ids[0] for k in range(20)]
    for k in range(20):  # the same row amid other rows, at another batch position, with other seeds around
        other = torch.randn(5, V)
        batch = torch.cat([other[:3], row[None], other[3:]])
        requests = [req(), req(seed=9), req(temperature=0.0), req(num_output_tokens=k, **seeded), req(top_k=5)]
        assert sample(batch, requests).token_ids[3] == alone[k]
    assert len(set(alone)) > 1, "the output position must feed the seed"
    different_seed = [sample(row[None], [req(num_output_tokens=k, **{**seeded, "seed": 99})]).token_ids[0]
                      for k in range(20)]
    assert different_seed != alone


def test_row_seed_mixes_inputs():
    seeds = {row_seed(s, k) for s in (-1, 0, 1, 2**63) for k in range(50)}
    assert len(seeds) == 200 and all(0 <= s < 2**64 for s in seeds)


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.zeros(3, V)
    logits[:, 7] = 100.0  # EOS dominates
    logits[:, 9] = 90.0  # then a stop token
    requests = [
        req(eos=7, pending=True, temperature=0.0, stop_token_ids=[9]),
        req(eos=7, pending=False, temperature=0.0),
        req(eos=7, pending=True, temperature=1.0, stop_token_ids=[9]),
    ]
    tokens = sample(logits, requests).token_ids
    assert tokens[0] not in (7, 9) and tokens[1] == 7 and tokens[2] not in (7, 9)
    assert logits[0, 7] == 100.0  # the caller's logits are not modified


def test_logprobs_are_raw_log_softmax_with_top_n():
    torch.manual_seed(2)
    logits = torch.randn(3, V)
    requests = [req(temperature=0.0, logprobs=3), req(temperature=0.0), req(temperature=0.7, logprobs=0, seed=5)]
    out = sample(logits, requests)
    expected = torch.log_softmax(logits, -1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    assert math.isclose(first.logprob, expected[0, first.token_id].item(), rel_tol=1e-5)
    top = expected[0].topk(3)
    assert [t for t, _ in first.top] == top.indices.tolist()
    assert all(math.isclose(lp, want, rel_tol=1e-5)
               for (_, lp), want in zip(first.top, top.values.tolist(), strict=True))
    assert out.logprobs[1] is None
    third = out.logprobs[2]
    assert third.top == [] and math.isclose(third.logprob, expected[2, out.token_ids[2]].item(), rel_tol=1e-5)


@pytest.mark.parametrize("vocab, slope", [(4000, 2e-3), (10000, 1e-5)])
def test_wide_nucleus_matches_sorted_reference(vocab, slope):
    """Nuclei wider than the first candidate pools (and than the second) must still be exact."""
    logits = -torch.arange(vocab, dtype=torch.float32) * slope
    probs = torch.softmax(logits, -1)
    mass_before = probs.cumsum(-1) - probs
    nucleus = int((mass_before < 0.6).sum())
    assert nucleus > 256
    n = 400
    tokens = sample(logits.repeat(n, 1), [req(top_p=0.6, seed=i) for i in range(n)]).token_ids
    assert max(tokens) < nucleus and max(tokens) > nucleus // 2


def mixed_batch(vocab: int, n_rows: int = 12, seed: int = 0):
    """Every kind of row: greedy, plain, seeded, top-k / top-p / min-p alone and together, logprobs, min_tokens."""
    kinds = [
        dict(temperature=0.0), dict(), dict(seed=7), dict(top_k=5, seed=1), dict(top_p=0.9, seed=2),
        dict(min_p=0.05, seed=3), dict(top_k=40, top_p=0.8, min_p=0.01, seed=4), dict(temperature=0.0, logprobs=3),
        dict(top_p=0.5, logprobs=0, seed=5), dict(top_k=1, temperature=1.3), dict(top_p=1e-300, seed=6),
        dict(temperature=1.7, top_p=0.99, seed=8),
    ]
    requests = [req(num_output_tokens=i, eos=3, pending=i % 4 == 0, **kinds[(i + seed) % len(kinds)])
                for i in range(n_rows)]
    return requests


def test_no_read_back_but_the_one_transfer(monkeypatch):
    """On the meta device any value read back raises: the whole sampler must run there but for its one transfer."""
    from sluice.service.executor import sampler

    transfers = []
    monkeypatch.setattr(sampler, "read_back", lambda t: transfers.append(t.shape) or [0.0] * t.numel())
    monkeypatch.setattr(sampler, "pools_allowed", lambda device: False)
    for vocab in (50, 1000):
        logits = torch.empty(12, vocab, device="meta")
        out = sample(logits, mixed_batch(vocab))
        assert len(out.token_ids) == 12 and out.logprobs[7] is not None and len(out.logprobs[7].top) == 3
    assert len(transfers) == 2


@pytest.mark.parametrize("vocab, scale", [(300, 1.0), (5000, 0.3), (5000, 8.0)])
def test_cpu_candidate_pools_match_the_full_sort(monkeypatch, vocab, scale):
    """Seeded tokens are the same whether the filters ran on a candidate pool or the device path's full sort."""
    from sluice.service.executor import sampler

    gen = torch.Generator().manual_seed(vocab)
    for trial in range(4):
        logits = torch.randn(12, vocab, generator=gen) * scale
        requests = mixed_batch(vocab, seed=trial)
        for r in requests:
            if r.sampling_params.seed is None:
                r.sampling_params.seed = 100 + trial
        pooled = sample(logits, requests).token_ids
        with monkeypatch.context() as m:
            m.setattr(sampler, "pools_allowed", lambda device: False)
            full = sample(logits, requests).token_ids
        assert pooled == full


def test_seeded_rows_keep_their_tokens_when_another_row_widens_the_pool():
    torch.manual_seed(3)
    logits = torch.randn(1, 6000) * 4
    seeded = [req(num_output_tokens=k, seed=11, top_p=0.9) for k in range(10)]
    alone = [sample(logits, [r]).token_ids[0] for r in seeded]
    flat = torch.zeros(1, 6000)  # min_p over a flat row keeps the whole vocabulary: the pools must widen to it
    with_flat = [sample(torch.cat([flat, logits]), [req(min_p=0.5), r]).token_ids[1] for r in seeded]
    assert alone == with_flat


def test_logprobs_for_a_subset_of_rows_in_one_transfer():
    torch.manual_seed(4)
    logits = torch.randn(5, V)
    requests = [req(temperature=0.0), req(logprobs=2, seed=1), req(), req(temperature=0.0, logprobs=5), req()]
    out = sample(logits, requests)
    expected = torch.log_softmax(logits, -1)
    for row, n in ((1, 2), (3, 5)):
        entry = out.logprobs[row]
        assert entry.token_id == out.token_ids[row] and len(entry.top) == n
        assert math.isclose(entry.logprob, expected[row, entry.token_id].item(), rel_tol=1e-5)
        assert [t for t, _ in entry.top] == expected[row].topk(n).indices.tolist()
    assert out.token_ids[3] == logits[3].argmax().item()
    assert [out.logprobs[i] for i in (0, 2, 4)] == [None] * 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampler_syncs_once(monkeypatch):
    from sluice.service.executor import sampler

    def read_back(values):
        torch.cuda.set_sync_debug_mode(0)
        return values.tolist()

    monkeypatch.setattr(sampler, "read_back", read_back)
    logits = torch.randn(12, 32000, device="cuda")
    sample(logits, mixed_batch(32000))  # warm up (allocations, pinned pool)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample(logits, mixed_batch(32000))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(0 <= t < 32000 for t in out.token_ids)
    assert out.token_ids[7] == logits[7].argmax().item()  # greedy, min_tokens met


def test_no_host_writes_into_device_logits(monkeypatch):
    """min_tokens masking and the filters write no host scalar into device tensors (tests/support/host_writes.py)."""
    from sluice.service.executor import sampler
    from tests.support.host_writes import HostWrites

    monkeypatch.setattr(sampler, "read_back", lambda t: [0.0] * t.numel())
    monkeypatch.setattr(sampler, "pools_allowed", lambda device: False)
    logits = torch.empty(12, 1000, device="meta")
    requests = mixed_batch(1000)
    assert any(r.min_tokens_pending for r in requests)
    with HostWrites() as writes:
        sample(logits, requests)
    assert writes.found == []
