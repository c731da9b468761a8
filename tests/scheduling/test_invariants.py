"""Property tests: random workloads over small pools keep the KV bookkeeping exact and outputs unchanged."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.scheduling.request import RequestStatus
from tests.support.fake_runner import reference_output
from tests.support.profiles import examples
from tests.support.sched_helpers import check_invariants, make_request, make_scheduler

workload = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(8, 40),
        "block_size": st.sampled_from([1, 2, 4, 8]),
        "num_host_blocks": st.integers(0, 24),
        "mode": st.sampled_from(["recompute", "swap"]),
        "policy": st.sampled_from(["fcfs", "priority"]),
        "max_num_seqs": st.integers(1, 8),
        "budget": st.integers(1, 48),
        "prefix_caching": st.booleans(),
        "requests": st.lists(
            st.tuples(
                st.integers(1, 30),  # prompt length
                st.integers(1, 12),  # max_tokens
                st.integers(0, 3),  # priority
                st.integers(0, 3),  # shared-prefix family
                st.integers(0, 40),  # step at which it arrives
                st.one_of(st.none(), st.integers(0, 40)),  # step at which it is aborted
            ),
            min_size=1,
            max_size=12,
        ),
    }
)


@settings(max_examples=examples(150, 1500, "SLUICE_HYPOTHESIS_EXAMPLES"), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(workload)
def test_random_workloads_keep_invariants_and_outputs(w):
    bs = w["block_size"]
    sched, runner = make_scheduler(
        num_blocks=w["num_blocks"],
        block_size=bs,
        num_host_blocks=w["num_host_blocks"],
        prefix_caching=w["prefix_caching"],
        preemption_mode=w["mode"],
        scheduling_policy=w["policy"],
        max_num_seqs=w["max_num_seqs"],
        max_num_batched_tokens=w["budget"],
    )
    capacity = w["num_blocks"] * bs
    families = {f: [(f * 97 + i * 31) % 1000 for i in range(40)] for f in range(4)}
    pending = []
    for i, (plen, max_tokens, prio, fam, arrive, abort_at) in enumerate(w["requests"]):
        plen = min(plen, capacity - 1)
        max_tokens = min(max_tokens, capacity - plen)
        p = families[fam][:plen] if i % 2 else families[fam][: plen // 2] + [i] * (plen - plen // 2)
        pending.append((arrive, f"r{i}", p, max_tokens, prio, abort_at))
    outputs: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    aborted = set()
    step = 0
    while step < 2000:
        for arrive, rid, p, mt, prio, _ in pending:
            if arrive == step:
                sched.add_request(make_request(rid, p, max_tokens=mt, priority=prio, arrival=float(step)))
        for _, rid, _, _, _, abort_at in pending:
            if abort_at == step and rid in sched.requests:
                sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
                aborted.add(rid)
                check_invariants(sched)
        if step > max(a for a, *_ in pending) and not sched.num_unfinished:
            break
        out = sched.schedule()
        assert out.num_batched_tokens <= w["budget"] and len(out.scheduled) <= w["max_num_seqs"]
        for ro in sched.update_from_output(out, runner.execute(out)):
            outputs.setdefault(ro.request_id, []).extend(ro.new_token_ids)
            if ro.finished:
                finished[ro.request_id] = ro.finish_reason
        check_invariants(sched)
        step += 1
    assert not sched.num_unfinished, "livelock: requests left after 2000 steps"
    assert sched.kv.num_free_blocks == w["num_blocks"]
    assert sched.kv.swap_space.num_free_blocks == w["num_host_blocks"]
    for _, rid, p, mt, _, _ in pending:
        if rid in aborted:
            continue
        assert finished[rid] == "length"
        assert outputs[rid] == reference_output(p, mt), rid
