"""The step cost model: it recovers a linear cost from measured steps, and follows the machine when it changes."""

from __future__ import annotations

import random

import pytest

from sluice.scheduling.cost_model import StepCostModel, StepShape, chunk_pairs


def random_shape(rng: random.Random, prefill: bool) -> StepShape:
    shape = StepShape()
    for _ in range(rng.randint(0, 24)):
        shape.add_decode(rng.randint(10, 2000), constrained=rng.random() < 0.3)
    if prefill or not shape.decode_rows:
        for _ in range(rng.randint(1, 3)):
            shape.add_chunk(rng.randint(0, 3000), rng.randint(1, 256))
    return shape


def linear_cost(coef: list[float]):
    return lambda shape: sum(c * x for c, x in zip(coef, shape.features(), strict=True))


# a, a_p, b, c, e, f, g: 4 ms a step, 2 ms more with prompt tokens, 0.5 ms a prompt token, 0.8 ms a decode row,
# 0.3 ms per thousand context tokens read, 1 ms per million attention pairs, 1.5 ms more a row under a grammar.
COST = [4e-3, 2e-3, 5e-4, 8e-4, 3e-4, 1e-3, 1.5e-3]


def test_chunk_pairs_counts_causal_query_key_pairs():
    assert chunk_pairs(0, 1) == 1 and chunk_pairs(0, 4) == 10 and chunk_pairs(100, 2) == 203


def test_fits_a_synthetic_linear_cost():
    rng, model, cost = random.Random(0), StepCostModel(), linear_cost(COST)
    for i in range(200):
        shape = random_shape(rng, prefill=i % 2 == 0)
        model.observe(shape, cost(shape))
    for i in range(50):
        shape = random_shape(rng, prefill=i % 2 == 0)
        assert model.predict(shape) == pytest.approx(cost(shape), rel=0.02)
    assert model.coef == pytest.approx(COST, rel=0.05, abs=1e-5)


def test_noisy_steps_still_predict_within_a_few_percent_and_no_coefficient_is_negative():
    rng, model, cost = random.Random(1), StepCostModel(), linear_cost(COST)
    for i in range(400):
        shape = random_shape(rng, prefill=i % 3 != 0)
        model.observe(shape, cost(shape) * rng.uniform(0.9, 1.1))
    assert min(model.coef) >= 0
    errors = []
    for i in range(100):
        shape = random_shape(rng, prefill=i % 2 == 0)
        errors.append(abs(model.predict(shape) / cost(shape) - 1))
    assert sum(errors) / len(errors) < 0.05


def test_adapts_when_the_cost_changes():
    """A machine that slows down (a neighbour takes the cores): within a hundred steps the model follows."""
    rng, model = random.Random(2), StepCostModel()
    before, after = linear_cost(COST), linear_cost([3 * c for c in COST])
    for i in range(200):
        shape = random_shape(rng, prefill=i % 2 == 0)
        model.observe(shape, before(shape))
    shape = random_shape(rng, prefill=True)
    assert model.predict(shape) < 0.5 * after(shape)  # what it knew before the change
    for i in range(100):
        shape = random_shape(rng, prefill=i % 2 == 0)
        model.observe(shape, after(shape))
    for i in range(20):
        shape = random_shape(rng, prefill=i % 2 == 0)
        assert model.predict(shape) == pytest.approx(after(shape), rel=0.1)


def test_a_stalled_step_barely_moves_the_fit():
    """A neighbour takes the cores for one step (30 times as long): the next predictions stay within 15%."""
    rng, model, cost = random.Random(5), StepCostModel(), linear_cost(COST)
    for i in range(100):
        shape = random_shape(rng, prefill=i % 2 == 0)
        model.observe(shape, cost(shape))
    shape = random_shape(rng, prefill=True)
    model.observe(shape, 30 * cost(shape))
    for i in range(20):
        shape = random_shape(rng, prefill=i % 2 == 0)
        assert model.predict(shape) == pytest.approx(cost(shape), rel=0.15)


def test_decode_only_steps_are_remembered_through_a_long_stretch_of_mixed_steps():
    """The decode-only cost (the target's base) stays known while only mixed steps arrive, even if those alone
    cannot separate the fixed cost from the prefill one (the same chunk size every step)."""
    rng, model, cost = random.Random(3), StepCostModel(), linear_cost(COST)
    decode = StepShape()
    for _ in range(4):
        decode.add_decode(500)
    for _ in range(60):
        model.observe(decode, cost(decode))
    mixed = decode.copy()
    mixed.add_chunk(1000, 32)
    for _ in range(500):
        model.observe(mixed, cost(mixed) * rng.uniform(0.98, 1.02))
    assert model.predict(decode) == pytest.approx(cost(decode), rel=0.1)
    assert model.predict(mixed) == pytest.approx(cost(mixed), rel=0.03)


def test_unobserved_terms_stay_at_zero_and_nothing_before_any_step():
    model = StepCostModel()
    assert model.predict(random_shape(random.Random(4), prefill=True)) == 0 and not model.knows_prefill
    decode = StepShape()
    decode.add_decode(100)
    model.observe(decode, 0.01)
    assert not model.knows_prefill
    assert model.coef[1] == model.coef[2] == model.coef[5] == 0  # no prompt token seen: prefill terms unknown
    model.observe(StepShape(), 0.0)  # a step that measured nothing changes nothing
    assert model.observations == 1
