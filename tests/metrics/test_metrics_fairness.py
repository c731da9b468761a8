"""The latency budget's and fair shares' metrics: steps that kept the target, the target, tokens per tenant with
bounded labels, and the scheduler's decision on traced requests' prefill chunks."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from sluice.metrics.families import ITL_OUTCOMES
from sluice.metrics.prometheus import SluiceMetrics
from sluice.metrics.tenant_labels import OTHER, TenantLabels
from sluice.metrics.tracing import Timelines
from sluice.scheduling.output import SchedulerStats
from tests.support.fair_sim import Sim, request
from tests.support.sched_helpers import make_scheduler

MODEL = "m"


@pytest.fixture
def reg() -> CollectorRegistry:
    return CollectorRegistry()


def value(reg, name, **labels):
    return reg.get_sample_value(name, {"model_name": MODEL, **labels})


def test_itl_steps_and_target(reg):
    m = SluiceMetrics(MODEL, reg)
    for outcome in ITL_OUTCOMES:
        assert value(reg, "sluice_itl_target_steps_total", outcome=outcome) == 0
    m.observe_step(SchedulerStats(itl_target_s=0.05, itl_steps_kept=1, num_batched_tokens=9))
    m.observe_step(SchedulerStats(itl_target_s=0.04, itl_steps_missed=1, num_batched_tokens=9))
    m.observe_step(SchedulerStats(itl_target_s=0.04, itl_steps_kept=1, num_batched_tokens=9))
    assert value(reg, "sluice_itl_target_steps_total", outcome="kept") == 2
    assert value(reg, "sluice_itl_target_steps_total", outcome="missed") == 1
    assert value(reg, "sluice_itl_target_seconds") == 0.04
    m.observe_step(SchedulerStats())  # nothing decoding: no target
    assert value(reg, "sluice_itl_target_seconds") == 0


def test_tenant_tokens_have_bounded_labels(reg):
    m = SluiceMetrics(MODEL, reg)
    m.observe_step(SchedulerStats(tenant_tokens={"acme": 100, "globex": 7}))
    m.observe_step(SchedulerStats(tenant_tokens={"acme": 50}))
    assert value(reg, "sluice_tenant_served_tokens_total", tenant="acme") == 150
    assert value(reg, "sluice_tenant_served_tokens_total", tenant="globex") == 7
    for i in range(100):  # a hundred more tenants, each a sliver of the total: all of them under "other"
        m.observe_step(SchedulerStats(tenant_tokens={f"t{i}": 1}))
    series = {s.labels["tenant"] for f in reg.collect() if f.name == "sluice_tenant_served_tokens"
              for s in f.samples if s.name.endswith("_total")}
    assert series == {"acme", "globex", OTHER}
    total = sum(value(reg, "sluice_tenant_served_tokens_total", tenant=t) for t in series)
    assert total == 157 + 100  # every token counted once, under some label


def test_tenant_labels_go_to_the_heavy_tenants_and_stay_bounded():
    labels = TenantLabels(k=2, tracked=4)
    assert labels.label("a", 10) == "a"
    for i in range(6):  # many small ones churn the table: none is a large enough share of the total
        assert labels.label(f"s{i}", 1) == OTHER
    assert labels.label("heavy", 500) == "heavy"  # a late heavy tenant gets the slot left
    assert labels.label("heavier", 5000) == OTHER  # both slots taken for good: a counter's series never moves
    assert labels.labelled == {"a", "heavy"}
    many = TenantLabels(k=16)
    for i in range(10_000):
        many.label(f"t{i % 997}", 1 + i % 7)
    assert len(many.labelled) <= 16 and len(many._counts) <= many.tracked


def test_the_scheduler_counts_served_tokens_per_tenant():
    sched, runner = make_scheduler(num_blocks=512, block_size=4, max_num_batched_tokens=64)
    s = Sim(sched, runner)
    sched.add_request(request("a", 30, 5, tenant="acme"))
    sched.add_request(request("b", 10, 2, seed=1))  # no tenant: not counted by tenant
    served = {}
    for _ in range(10):
        s.step()
        for tenant, n in sched.make_stats().tenant_tokens.items():
            served[tenant] = served.get(tenant, 0) + n
    assert served == {"acme": 30 + 5}

    sched.add_request(request("c", 30, 1, tenant="acme"))  # a's prompt again: its cached blocks are not charged
    s.step()
    assert sched.make_stats().tenant_tokens == {"acme": 30 - 28 + 1}


def test_prefill_chunk_events_carry_the_schedulers_decision():
    sched, runner = make_scheduler(num_blocks=512, block_size=4, max_num_batched_tokens=8)
    timelines = Timelines()
    r = request("a", 20, 2)
    sched.add_request(r)
    timelines.start(r, trace_headers={})
    out = sched.schedule()
    timelines.on_step(out, 1.0, 2.0)
    chunk = next(e for e in timelines._traced["a"].events if e[0] == "prefill_chunk")
    assert chunk[2]["tokens"] == 8 and chunk[2]["prefill_budget"] == 8 and chunk[2]["flows_served"] == 1
    assert chunk[2]["decode_rows"] == 0 and chunk[2]["itl_target_ms"] == 0
