"""Directed tests around the happy path: the copy-order contract, failed steps, real pool checks, request-id
reuse, requests that can never fit, and the queue-wait bound. Each names the defect it guards against."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from sluice.scheduling.output import CopyOrderError, SchedulerOutput
from sluice.scheduling.request import RequestStatus
from sluice.scheduling.request_queue import FCFSQueue, PriorityQueue
from tests.support import REPO
from tests.support.fake_runner import InjectedFault, reference_output
from tests.support.sched_helpers import make_request, make_scheduler


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 7) % 1000 for i in range(n)]


# --- 1. the copy-order contract ----------------------------------------------------------------------


def test_copy_order_accepts_a_request_resumed_and_swapped_out_again_in_one_step():
    out = SchedulerOutput()
    out.add_swap_in("a", [(0, 5), (1, 6)])  # host -> device
    out.add_swap_out("a", [(5, 2), (6, 3)])  # the same device blocks straight back out: swap-ins run first
    out.check_copy_order()


def test_copy_order_refuses_a_block_freed_by_a_swap_out_going_to_a_later_swap_in():
    out = SchedulerOutput()
    out.add_swap_out("victim", [(5, 0)])
    out.add_swap_in("resumed", [(1, 5)])  # would overwrite block 5 before the swap-out reads it
    with pytest.raises(CopyOrderError, match="device block 5"):
        out.check_copy_order()


def test_copy_order_refuses_a_host_slot_written_then_read_in_one_step():
    out = SchedulerOutput()
    out.add_swap_out("victim", [(5, 0)])
    out.add_swap_in("resumed", [(0, 7)])  # would read host slot 0 before the swap-out writes it
    with pytest.raises(CopyOrderError, match="host slot 0"):
        out.check_copy_order()


def test_the_check_survives_python_O():
    code = textwrap.dedent("""
        from sluice.scheduling.output import CopyOrderError, SchedulerOutput
        out = SchedulerOutput()
        out.add_swap_out("v", [(5, 0)])
        out.add_swap_in("r", [(1, 5)])
        try:
            out.check_copy_order()
        except CopyOrderError:
            print("caught")
    """)
    assert _run_optimized(code) == "caught"


def test_scheduler_resumes_nothing_in_a_step_that_already_swapped_out():
    """Priority preemption swaps a victim out before the resume phase: the blocks it freed must not be handed to
    a swap-in of the same step. The state is set up by hand (priorities changed while queued), since the
    scheduler's own ordering makes it rare, not impossible."""
    sched, runner = make_scheduler(num_blocks=6, block_size=4, num_host_blocks=16, preemption_mode="swap",
                                   scheduling_policy="priority", max_num_seqs=2, max_num_batched_tokens=64)

    def step():
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
        return out

    a = make_request("A", prompt(8, 1), max_tokens=12, priority=0, arrival=0.0)
    sched.add_request(a)
    step()
    out = SchedulerOutput()
    sched._preempt(a, out)  # A is swapped out
    sched.update_from_output(out, runner.execute(out))
    a.priority = 10  # ... and ranks low for a moment, so that V is admitted while A waits in host memory
    sched.add_request(make_request("V", prompt(12, 2), max_tokens=8, priority=9, arrival=1.0))
    step()
    assert [r.request_id for r in sched.running] == ["V"] and sched.swapped == [a]
    a.priority = 0
    sched.add_request(make_request("H", prompt(16, 3), max_tokens=4, priority=4, arrival=2.0))
    out = sched.schedule()  # H outranks V and does not fit: V is swapped out before the resume phase
    assert out.swapped_out_ids == ["V"]
    assert not out.swap_in, "a swap-in in a step that swapped out may be handed the freed blocks"
    out.check_copy_order()
    sched.update_from_output(out, runner.execute(out))
    outputs = {}
    while sched.num_unfinished:
        o = sched.schedule()
        for ro in sched.update_from_output(o, runner.execute(o)):
            outputs.setdefault(ro.request_id, []).extend(ro.new_token_ids)
    assert outputs["V"][-1] == reference_output(prompt(12, 2), 8)[-1]


# --- 2. a failed step corrupts nothing ------------------------------------------------------------------


def _swap_heavy_scheduler():
    sched, runner = make_scheduler(num_blocks=12, block_size=4, num_host_blocks=32, preemption_mode="swap",
                                   max_num_batched_tokens=64)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", prompt(8, i), max_tokens=16, arrival=float(i)))
    return sched, runner


def _run_with_fault(fault: str, when, starve_resumed: bool = False) -> tuple[dict, dict, object]:
    """Run the swap-heavy workload; fail the first step for which `when(out)` holds, inside `fault`.

    `starve_resumed` drops the step budget to one token while requests are swapped out, so a resumed request
    can sit behind a running one that takes the whole budget (as behind a long prefill chunk).
    """
    sched, runner = _swap_heavy_scheduler()
    outputs, reasons, failed = {}, {}, None
    for _ in range(500):
        if not sched.num_unfinished:
            break
        if starve_resumed:
            sched.config.max_num_batched_tokens = 1 if sched.swapped else 64
        out = sched.schedule()
        if failed is None and when(out):
            failed, runner.fail_next = out, fault
        try:
            result = runner.execute(out)
        except InjectedFault:
            for ro in sched.fail_step(out):
                reasons[ro.request_id] = ro.finish_reason
            continue
        for ro in sched.update_from_output(out, result):
            outputs.setdefault(ro.request_id, []).extend(ro.new_token_ids)
            if ro.finished:
                reasons[ro.request_id] = ro.finish_reason
    assert failed is not None, "the fault never fired"
    assert not sched.num_unfinished
    assert sched.kv.num_free_blocks == 12 and sched.kv.swap_space.num_free_blocks == 32
    return outputs, reasons, failed


def _check_survivors(outputs, reasons, failed):
    scheduled = {s.request_id for s in failed.scheduled}
    for i in range(4):
        rid = f"r{i}"
        if rid in scheduled:
            assert reasons[rid] == "error"
        else:
            assert reasons[rid] == "length", (rid, reasons)
            assert outputs[rid] == reference_output(prompt(8, i), 16), f"{rid} continued on corrupt KV"


def test_failure_inside_the_swap_in_copy_keeps_the_resumed_request_on_its_host_copy():
    """Today's code leaves a resumed-but-unscheduled request RUNNING on blocks the failed copy never filled
    and has already freed its host slots."""
    def resumed_but_not_scheduled(out):
        return set(out.swapped_in_ids) - {s.request_id for s in out.scheduled}

    outputs, reasons, failed = _run_with_fault("swap_in", resumed_but_not_scheduled, starve_resumed=True)
    _check_survivors(outputs, reasons, failed)


def test_failure_inside_the_swap_out_copy_recomputes_the_victim():
    """Today's code leaves the victim SWAPPED on a host copy that was never finished."""
    outputs, reasons, failed = _run_with_fault("swap_out", lambda o: o.swap_out)
    assert set(failed.swapped_out_ids) - {s.request_id for s in failed.scheduled}
    _check_survivors(outputs, reasons, failed)


def test_failure_inside_the_forward_fails_its_batch_and_uncaches_what_it_was_writing():
    outputs, reasons, failed = _run_with_fault("forward", lambda o: len(o.scheduled) >= 2)
    _check_survivors(outputs, reasons, failed)


def test_forward_failure_does_not_leave_a_garbage_prefix_for_the_next_request():
    sched, runner = make_scheduler(num_blocks=16, block_size=4)
    shared = prompt(12, 5)
    sched.add_request(make_request("first", shared + [1], max_tokens=2))
    out = sched.schedule()
    runner.fail_next = "forward"
    with pytest.raises(InjectedFault):
        runner.execute(out)
    sched.fail_step(out)
    sched.add_request(make_request("second", shared + [2], max_tokens=3))
    outputs = {}
    while sched.num_unfinished:
        out = sched.schedule()
        for ro in sched.update_from_output(out, runner.execute(out)):
            outputs.setdefault(ro.request_id, []).extend(ro.new_token_ids)
    assert outputs["second"] == reference_output(shared + [2], 3)


# --- 3. pool invariants are checks, not asserts ---------------------------------------------------------


def _run_optimized(code: str) -> str:
    result = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=str(REPO))
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_free_queue_never_hands_out_its_sentinel_under_python_O():
    code = textwrap.dedent("""
        from sluice.kvcache.block import FreeBlockQueue, KVCacheBlock
        q = FreeBlockQueue([KVCacheBlock(0)])
        q.popleft()
        try:
            b = q.popleft()
            print("handed out", b.block_id)
        except RuntimeError:
            print("refused")
    """)
    assert _run_optimized(code) == "refused"


def test_host_slot_freed_twice_is_refused_under_python_O():
    code = textwrap.dedent("""
        from sluice.kvcache.swap_space import SwapSpace
        s = SwapSpace(4)
        a = s.allocate(2)
        s.free(a)
        try:
            s.free(a[:1])
            print("freed twice, free =", s.num_free_blocks)
        except RuntimeError:
            print("refused", s.num_free_blocks)
    """)
    assert _run_optimized(code) == "refused 4"


def test_host_slots_of_a_swap_in_stay_taken_until_the_step_is_done():
    sched, runner = _swap_heavy_scheduler()
    while True:
        out = sched.schedule()
        if out.swap_in:
            break
        sched.update_from_output(out, runner.execute(out))
    read = [h for h, _ in out.swap_in]
    free_now = sched.kv.swap_space.num_free_blocks
    sched.update_from_output(out, runner.execute(out))
    assert sched.kv.swap_space.num_free_blocks >= free_now + len(read) - len(out.swap_out)


# --- 4. request ids and requests that never fit -----------------------------------------------------------


@pytest.mark.parametrize("queue_cls", [FCFSQueue, PriorityQueue])
def test_an_aborted_id_added_again_is_not_dropped_with_its_stale_entry(queue_cls):
    q = queue_cls()
    old = make_request("same", [1, 2], priority=5, arrival=0.0)
    q.push(old)
    q.remove(old)
    new = make_request("same", [3, 4], priority=0, arrival=1.0)  # ahead of the stale entry in both orders
    q.push_front(new) if queue_cls is FCFSQueue else q.push(new)
    assert len(q) == 1 and q.peek() is new and q.pop() is new and not q


def test_scheduler_runs_a_request_whose_id_was_aborted_and_reused():
    sched, runner = make_scheduler(num_blocks=32, block_size=4, scheduling_policy="priority")
    sched.add_request(make_request("x", prompt(6, 1), max_tokens=4, priority=3, arrival=0.0))
    sched.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    sched.add_request(make_request("x", prompt(6, 2), max_tokens=4, priority=0, arrival=1.0))
    outputs = {}
    for _ in range(20):
        out = sched.schedule()
        for ro in sched.update_from_output(out, runner.execute(out)):
            outputs.setdefault(ro.request_id, []).extend(ro.new_token_ids)
    assert outputs.get("x") == reference_output(prompt(6, 2), 4) and not sched.num_unfinished


def test_a_request_longer_than_the_kv_cache_is_refused_not_cut_short():
    sched, _ = make_scheduler(num_blocks=4, block_size=4)  # 16 tokens in all
    with pytest.raises(ValueError, match="KV cache holds 16 tokens"):
        sched.add_request(make_request("big", prompt(10, 1), max_tokens=8))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", prompt(4, 1), max_tokens=4))
        sched.add_request(make_request("ok", prompt(4, 1), max_tokens=4))


# --- 5. the queue-wait bound --------------------------------------------------------------------------------


def test_max_queue_wait_ends_a_starved_low_priority_request():
    sched, runner = make_scheduler(num_blocks=64, block_size=4, scheduling_policy="priority", max_num_seqs=1,
                                   max_queue_wait=5.0)
    sched.add_request(make_request("low", prompt(4, 0), max_tokens=2, priority=9, arrival=0.0))
    expired, now = [], 0.0
    for i in range(30):  # a steady stream of urgent requests keeps the only seat busy
        now = float(i)
        sched.add_request(make_request(f"hi{i}", prompt(4, i + 1), max_tokens=1, priority=0, arrival=now))
        expired += sched.expire_waiting(now)
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    assert [r.request_id for r in expired][:1] == ["low"]
    assert expired[0].status == RequestStatus.FINISHED_ABORTED and "low" not in sched.requests
    assert all(r.first_scheduled_time is None for r in expired)


def test_max_queue_wait_spares_requests_that_already_ran():
    sched, runner = make_scheduler(num_blocks=64, block_size=4, max_queue_wait=1.0)
    sched.add_request(make_request("a", prompt(4, 0), max_tokens=5, arrival=0.0))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    assert sched.expire_waiting(100.0) == [] and "a" in sched.requests
