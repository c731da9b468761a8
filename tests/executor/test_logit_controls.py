"""Penalties, logit_bias, allowed_token_ids and bad words: the batched processor against a per-row reference,
and their effect on a real (tiny) model's greedy output; neutral values change nothing."""

from __future__ import annotations

import random

import pytest
import torch

from sluice.scheduling.output import ScheduledRequest
from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.executor.logits_controls import AllowedMasks, apply_logit_controls, disallowed_mask

V = 50


def row(params: SamplingParams, prompt: list[int], output: list[int]) -> ScheduledRequest:
    history = prompt + output
    return ScheduledRequest("r", [history[-1]], len(history) - 1, [0], True, params, len(output),
                            token_history=history if params.needs_token_history else None,
                            num_prompt_tokens=len(prompt))


def reference(logits: torch.Tensor, r: ScheduledRequest) -> torch.Tensor:
    """One row, written the obvious way (loops over tokens)."""
    p, x = r.sampling_params, logits.clone()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if p.allowed_token_ids is not None:
        keep = x.clone()
        x[:] = float("-inf")
        for t in p.allowed_token_ids:
            x[t] = keep[t]
    history = r.token_history or []
    output = history[r.num_prompt_tokens:]
    for word in p.bad_words_token_ids:
        if len(word) == 1 or output[-(len(word) - 1):] == word[:-1]:
            x[word[-1]] = float("-inf")
    if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
        for t in set(history):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        for t in set(output):
            x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


@pytest.mark.parametrize("seed", range(20))
def test_batched_controls_equal_the_per_row_reference(seed):
    rng = random.Random(seed)
    requests = []
    for _ in range(6):
        kind = rng.randrange(5)
        params = SamplingParams(
            presence_penalty=rng.choice([0.0, 0.7]) if kind in (0, 4) else 0.0,
            frequency_penalty=rng.choice([0.0, -0.5, 1.5]) if kind in (0, 4) else 0.0,
            repetition_penalty=rng.choice([1.0, 1.3, 0.8]) if kind in (0, 4) else 1.0,
            logit_bias={rng.randrange(V): rng.uniform(-100, 100) for _ in range(3)} if kind == 1 else None,
            allowed_token_ids=rng.sample(range(V), 5) if kind == 2 else None,
            bad_words_token_ids=[[rng.randrange(V)], [rng.randrange(V), rng.randrange(V)]] if kind == 3 else [],
        )
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 8))]
        output = [rng.randrange(V) for _ in range(rng.randrange(0, 8))]
        if kind == 2 and rng.random() < 0.5:  # as admitted by the engine: with its mask (else built per step)
            params.disallowed_token_mask = AllowedMasks(V, torch.device("cpu")).get(params.allowed_token_ids)
        requests.append(row(params, prompt, output))
    logits = torch.randn(len(requests), V, generator=torch.Generator().manual_seed(seed)) * 3
    want = torch.stack([reference(logits[i], r) for i, r in enumerate(requests)])
    got = logits.clone()
    apply_logit_controls(got, requests)
    torch.testing.assert_close(got, want)


def test_neutral_controls_leave_the_logits_bit_identical():
    r = row(SamplingParams(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias={}),
            [1, 2], [3])
    logits = torch.randn(2, V)
    before = logits.clone()
    apply_logit_controls(logits, [r, r])
    assert torch.equal(logits, before)


# --- on a real model -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from sluice.service.config import SluiceConfig
    from sluice.service.engine.engine import LLMEngine
    from tests.support.tiny import save_tiny_model

    config = SluiceConfig()
    config.model.model = save_tiny_model(str(tmp_path_factory.mktemp("tiny-controls")))
    config.model.device, config.model.dtype = "cpu", "float32"
    config.cache.num_kv_blocks = 64
    return LLMEngine(config)


GREEDY = dict(max_tokens=30, temperature=0.0, ignore_eos=True)


def test_logit_bias_plus_100_makes_greedy_emit_that_token(engine):
    target = 123
    (r,) = engine.generate(["Hello world"], SamplingParams(**GREEDY, logit_bias={target: 100.0}))
    assert r.token_ids == [target] * 30


def test_allowed_token_ids_and_bad_words(engine):
    (r,) = engine.generate(["Hello world"], SamplingParams(**GREEDY, allowed_token_ids=[50, 60, 70]))
    assert set(r.token_ids) <= {50, 60, 70}
    (free,) = engine.generate(["The capital of France is"], SamplingParams(**GREEDY))
    banned = engine.tokenizer.decode([free.token_ids[0]])
    (r,) = engine.generate(["The capital of France is"], SamplingParams(**GREEDY, bad_words=[banned.strip() or banned]))
    assert free.token_ids[0] not in r.token_ids[:1]


def test_admission_builds_one_mask_per_allowed_list_and_refuses_ids_outside_the_vocabulary(engine):
    allowed = list(range(40, 60)) * 3
    params = SamplingParams(**GREEDY, allowed_token_ids=allowed)
    for rid in ("m1", "m2"):
        engine.add_request(rid, "Hello world", params)
    masks = [engine.scheduler.requests[rid].sampling_params.disallowed_token_mask for rid in ("m1", "m2")]
    assert masks[0] is masks[1] and masks[0].shape == (engine.vocab_size,) and int((~masks[0]).sum()) == 20
    for rid in ("m1", "m2"):
        engine.abort_request(rid)
    engine.step()
    with pytest.raises(ValueError, match="allowed_token_ids"):
        engine.add_request("m3", "Hello world", SamplingParams(**GREEDY, allowed_token_ids=[1, engine.vocab_size]))


def test_frequency_penalty_lowers_repetition(engine):
    def most_common_share(params):
        (r,) = engine.generate(["Hello Hello Hello Hello"], params)
        return max(r.token_ids.count(t) for t in set(r.token_ids)) / len(r.token_ids)

    plain = most_common_share(SamplingParams(**GREEDY))
    penalised = most_common_share(SamplingParams(**GREEDY, frequency_penalty=2.0, presence_penalty=0.5))
    assert plain > 0.2, "the workload should repeat without a penalty"
    assert penalised < plain


def test_neutral_values_keep_greedy_output_identical(engine):
    prompts = ["Hello world", "Streaming tokens over server-sent events"]
    base = engine.generate(prompts, SamplingParams(**GREEDY))
    neutral = engine.generate(prompts, SamplingParams(**GREEDY, presence_penalty=0.0, frequency_penalty=0.0,
                                                      repetition_penalty=1.0, logit_bias={}, bad_words=[]))
    assert [r.token_ids for r in base] == [r.token_ids for r in neutral]


def test_no_host_writes_into_device_logits():
    """Every control on meta logits (where a CUDA host sync shows up as a host write; tests/support/host_writes.py)."""
    from tests.support.host_writes import HostWrites

    requests = [
        row(SamplingParams(logit_bias={3: 5.0, 7: -2.0}), [1, 2], [3]),
        row(SamplingParams(allowed_token_ids=[4, 5, 5, 9]), [1], []),
        row(SamplingParams(allowed_token_ids=[4, 5, 5, 9]), [1], [4]),
        row(SamplingParams(bad_words_token_ids=[[6], [2, 8]]), [1], [2]),
        row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2), [1, 2], [2, 2]),
        row(SamplingParams(), [1], []),
    ]
    logits = torch.empty(len(requests), V, device="meta")
    with HostWrites() as writes:
        apply_logit_controls(logits, requests)
    assert writes.found == []


def test_allowed_ids_mask_keeps_exactly_the_listed_tokens_across_rows_sharing_or_not_one_mask():
    shared = [7, 3, 3, 49, 0, 7]  # duplicates change nothing
    masks = AllowedMasks(V, torch.device("cpu"))
    assert masks.get(shared) is masks.get(shared)  # one list object (an API call's n x prompts): one mask
    allowed_ids = (~disallowed_mask(shared, V, torch.device("cpu"))).nonzero()[:, 0]
    assert allowed_ids.tolist() == [0, 3, 7, 49]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        disallowed_mask([1, V], V, torch.device("cpu"))
    other = [5]
    requests = [row(SamplingParams(allowed_token_ids=shared, disallowed_token_mask=masks.get(shared)), [1], []),
                row(SamplingParams(), [1], []),
                row(SamplingParams(allowed_token_ids=other), [1], []),  # no mask: built for the step
                row(SamplingParams(allowed_token_ids=shared, disallowed_token_mask=masks.get(shared)), [1], [])]
    logits = torch.randn(4, V)
    got = logits.clone()
    apply_logit_controls(got, requests)
    for i, keep in ((0, {0, 3, 7, 49}), (2, {5}), (3, {0, 3, 7, 49})):
        assert {t for t in range(V) if got[i, t] > float("-inf")} == keep
        assert torch.equal(got[i, sorted(keep)], logits[i, sorted(keep)])
    assert torch.equal(got[1], logits[1])
    # Every row constrained by one mask: the broadcast path.
    got = logits.clone()
    apply_logit_controls(got, [requests[0], requests[3]] * 2)
    assert torch.equal(got > float("-inf"), (~masks.get(shared)).expand(4, V))
