"""Fair shares: VTC's counters and their bound, a flow's fan-out against a newcomer, tenants, priorities.

The bound (scheduling/fairness.py): for clients f, g backlogged together at one priority level with no preemption
in between, C_g - C_f <= w_p * (L + Q) + w_o * M (L: the longest prompt, Q: the largest grant of a step, M: the
tokens g's running requests can still generate). The property test checks it after every step of random
workloads, with w_o = 0 (the prompt share alone: w_p * (L + Q)) and with w_o > 0.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.scheduling.fairness import MAX_IDLE_CLIENTS, VirtualCounters
from tests.support.fair_sim import Sim, request
from tests.support.sched_helpers import check_invariants, make_scheduler


def test_a_newly_backlogged_client_is_lifted_to_the_least_backlogged_counter():
    c = VirtualCounters(prompt_weight=1.0, output_weight=2.0)
    c.refresh_backlog({"a", "b"})
    c.charge("a", prompt_tokens=100)
    c.charge("b", prompt_tokens=40)
    c.charge_output("b", 5)
    assert c.value("a") == 100 and c.value("b") == 50
    c.refresh_backlog({"a", "b", "new"})
    assert c.value("new") == 50  # no credit for the time it was away
    c.refresh_backlog({"a"})  # b and new have nothing pending now
    c.charge("a", prompt_tokens=30)
    c.refresh_backlog({"a", "b"})
    assert c.value("b") == 130  # lifted to a's 130: b's own 50 was earned before
    c.refresh_backlog(set())
    c.refresh_backlog({"late"})
    assert c.value("late") == 130  # nobody backlogged: the floor the last ones left


def test_a_returning_client_keeps_a_counter_above_the_least():
    c = VirtualCounters()
    c.refresh_backlog({"heavy", "light"})
    c.charge("heavy", prompt_tokens=1000)
    c.refresh_backlog({"light"})
    c.refresh_backlog({"light", "heavy"})
    assert c.value("heavy") == 1000 and c.value("light") == 0


def test_idle_clients_are_forgotten_beyond_a_bound():
    c = VirtualCounters()
    for i in range(MAX_IDLE_CLIENTS + 10):
        c.open(f"c{i}")
        c.charge(f"c{i}", prompt_tokens=1)
        c.close(f"c{i}")
    assert len(c.values()) == MAX_IDLE_CLIENTS
    c.open("live")
    c.charge("live", prompt_tokens=5)
    for i in range(MAX_IDLE_CLIENTS + 10):
        c.close(f"x{i}")
    assert c.value("live") == 5  # a client with a live request is never dropped


def run_workload(arrivals, w_o: float, budget: int, max_itl_ms: float = 0.0):
    """Steps a scheduler through `arrivals` (step -> [(client, prompt_len, max_tokens)]), checking the bound
    after every step; returns the sim."""
    sched, runner = make_scheduler(num_blocks=4096, block_size=4, max_num_seqs=256, max_num_batched_tokens=budget,
                                   fair_output_weight=w_o, max_itl_ms=max_itl_ms)
    s = Sim(sched, runner)
    longest = max((p for arr in arrivals.values() for _, p, _ in arr), default=1)
    most_outputs = max((m for arr in arrivals.values() for _, _, m in arr), default=1)
    bound = sched.counters.prompt_weight * (longest + budget) + w_o * sched.config.max_num_seqs * most_outputs
    n = 0
    for step in range(400):
        for client, plen, max_tokens in arrivals.get(step, ()):
            sched.add_request(request(f"r{n}", plen, max_tokens, flow=f"r{n}", tenant=client, seed=n))
            n += 1
        if not sched.num_unfinished and step > max(arrivals, default=0):
            break
        s.step()
        backlogged = sched.counters.backlogged
        values = {c: sched.counters.value(c) for c in backlogged}
        if values:
            assert max(values.values()) - min(values.values()) <= bound + 1e-9, (step, values, bound)
    assert not any(out.preempted_ids for out in s.steps)  # the bound is stated without preemption
    check_invariants(sched)
    return s


workloads = st.dictionaries(
    st.integers(0, 60),
    st.lists(st.tuples(st.sampled_from("abcde"), st.integers(1, 300), st.integers(1, 12)), min_size=1, max_size=4),
    min_size=1, max_size=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(arrivals=workloads, budget=st.sampled_from([16, 64, 256]))
def test_counter_difference_among_backlogged_clients_stays_within_the_bound(arrivals, budget):
    run_workload(arrivals, w_o=0.0, budget=budget)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(arrivals=workloads)
def test_the_bound_with_output_charges(arrivals):
    run_workload(arrivals, w_o=2.0, budget=64)


def test_a_single_streams_tenant_gets_its_share_beside_32_long_requests():
    """Tenant `bulk` sends 32 long prompts at once; tenant `solo` has one stream, then a short question: the
    stream gets a token every step, and the question is served ahead of bulk's remaining prompts."""
    sched, runner = make_scheduler(num_blocks=8192, block_size=4, max_num_seqs=64, max_num_batched_tokens=128)
    s = Sim(sched, runner)
    sched.add_request(request("stream", 8, 300, tenant="solo", seed=1))
    s.run(3)
    for i in range(32):
        sched.add_request(request(f"bulk{i}", 400, 1, tenant="bulk", seed=100 + i))
    s.run(20)
    sched.add_request(request("question", 12, 4, tenant="solo", seed=2))
    asked = len(s.steps)
    s.run(600, until=lambda: sched.num_unfinished == 1 and "stream" in sched.requests)
    assert all(s.scheduled(out, "stream") == 1 for out in s.steps[3:asked + 50])  # a token every step
    assert s.first_token_step["question"] - asked <= 3
    bulk_done = [s.first_token_step[f"bulk{i}"] for i in range(32)]
    assert max(bulk_done) < len(s.steps)  # the bulk tenant finished too


def test_a_64_prompt_flow_does_not_hold_back_a_newcomers_first_token():
    sched, runner = make_scheduler(num_blocks=8192, block_size=4, max_num_seqs=64, max_num_batched_tokens=128)
    s = Sim(sched, runner)
    for i in range(64):
        sched.add_request(request(f"big{i}", 300, 2, flow="big", seed=i))
    s.run(10)
    sched.add_request(request("newcomer", 10, 5, seed=999))
    arrived = len(s.steps)
    s.run(3)
    assert s.first_token_step.get("newcomer", 99) - arrived <= 2
    s.run(2000, until=lambda: not sched.num_unfinished)
    assert all(len(s.tokens[f"big{i}"]) == 2 for i in range(64))


def test_one_flow_never_holds_every_seat():
    sched, runner = make_scheduler(num_blocks=8192, block_size=4, max_num_seqs=16, max_num_batched_tokens=512)
    s = Sim(sched, runner)
    for i in range(40):
        sched.add_request(request(f"n{i}", 20, 50, flow="call", seed=i))
    s.run(20)
    assert sum(r.flow_id == "call" for r in sched.running) == sched.config.flow_seats == 14
    sched.add_request(request("other", 5, 3, seed=777))
    arrived = len(s.steps)
    s.run(2)
    assert s.first_token_step["other"] - arrived <= 1


def test_the_samples_of_one_prompt_are_prefilled_in_turn_and_share_its_blocks():
    """n samples of a prompt are one flow: the first is prefilled, the others then hit its cached blocks."""
    sched, runner = make_scheduler(num_blocks=4096, block_size=4, max_num_batched_tokens=64)
    s = Sim(sched, runner)
    for i in range(8):
        sched.add_request(request(f"n{i}", 200, 3, flow="sampled", seed=5))
    s.run(100, until=lambda: not sched.num_unfinished)
    computed = sum(row.num_tokens for out in s.steps for row in out.scheduled if row.num_output_tokens == 0)
    assert computed < 2 * 200  # not 8 x 200: the seven others recompute at most their last block
    assert len({tuple(t) for t in s.tokens.values()}) == 1


def test_priorities_come_before_service():
    sched, runner = make_scheduler(num_blocks=4096, block_size=4, max_num_batched_tokens=32,
                                   scheduling_policy="priority")
    s = Sim(sched, runner)
    sched.add_request(request("low", 200, 1, priority=5, tenant="low", seed=1))
    s.run(2)
    sched.counters.charge("tenant:high", prompt_tokens=10_000)  # far more served than `low`
    sched.add_request(request("high", 100, 1, priority=0, tenant="high", seed=2))
    out = s.step()
    assert s.scheduled(out, "high") == 32 and s.scheduled(out, "low") == 0
