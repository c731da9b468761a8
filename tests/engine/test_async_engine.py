"""AsyncEngine against a fake LLMEngine: threading, aborts, overflow, death and drain."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineDrainingError,
    QueueFullError,
)
from tests.support.fake_engine import FakeEngine

pytestmark = [pytest.mark.timeout(30), pytest.mark.anyio]


@pytest.fixture
def anyio_backend():
    return "asyncio"


def params(n=5):
    return SamplingParams(max_tokens=n)


async def started(fake, **kw) -> AsyncEngine:
    eng = AsyncEngine(fake, **kw)
    eng.start()
    return eng


async def until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_stream_runs_to_completion_on_one_worker_thread():
    fake = FakeEngine()
    eng = await started(fake)
    async with await eng.add_request("a", [1, 2], params(5)) as stream:
        outs = [o async for o in stream]
    assert [o.text for o in outs] == ["x"] * 5 and outs[-1].finish_reason == "length"
    assert len(fake.threads) == 1 and threading.get_ident() not in fake.threads
    await until(lambda: eng.stats.get("free_blocks") == 10)
    assert eng.num_open_streams == 0 and eng.num_waiting == 0
    await eng.shutdown()


async def test_memory_is_trimmed_once_the_engine_has_been_idle_a_while(monkeypatch):
    from sluice.service.engine import async_engine

    monkeypatch.setattr(async_engine, "IDLE_TRIM_S", 1.0)
    fake, trims = FakeEngine(), []
    monkeypatch.setattr(async_engine, "release_freed_memory", lambda: trims.append(fake.requests.copy()))
    eng = await started(fake)
    await read_all(await eng.add_requests([("a", [1], params(3)), ("b", [1], params(6))]))
    await read_all(await eng.add_request("c", [1], params(2)))  # back to back: no trim between them
    assert trims == []
    await until(lambda: trims)
    assert trims == [{}]  # once, after the last request, while none ran
    fake.device = torch.device("meta")  # an accelerator's memory is not malloc's
    await read_all(await eng.add_request("d", [1], params(2)))
    await asyncio.sleep(1.5)
    await eng.shutdown()
    assert len(trims) == 1


async def test_a_server_left_idle_after_start_up_trims_once(monkeypatch):
    from sluice.service.engine import async_engine

    monkeypatch.setattr(async_engine, "IDLE_TRIM_S", 0.2)
    fake, trims = FakeEngine(), []
    monkeypatch.setattr(async_engine, "release_freed_memory", lambda: trims.append(1))
    eng = await started(fake)
    await until(lambda: trims)
    await asyncio.sleep(0.6)
    await eng.shutdown()
    assert trims == [1]


async def read_all(stream) -> list:
    """Every output of a stream, closing it after."""
    async with stream:
        return [o async for o in stream]


async def test_group_streams_all_members():
    eng = await started(FakeEngine())
    stream = await eng.add_requests([("g-0", [1], params(3)), ("g-1", [1], params(4))])
    outs = await read_all(stream)
    assert sum(o.request_id == "g-0" for o in outs) == 3 and sum(o.request_id == "g-1" for o in outs) == 4
    await eng.shutdown()


async def test_closing_early_aborts_and_frees():
    fake = FakeEngine(step_delay=0.01)
    eng = await started(fake)
    async with await eng.add_request("a", [1], params(1000)) as stream:
        await stream.__anext__()
    await until(lambda: not fake.has_unfinished_requests())
    assert fake.aborted == ["a"]
    await until(lambda: eng.stats["free_blocks"] == 10)
    await eng.shutdown()


async def test_cancelled_consumer_aborts():
    fake = FakeEngine(step_delay=0.01)
    eng = await started(fake)

    async def consume():
        async with await eng.add_request("a", [1], params(1000)) as stream:
            async for _ in stream:
                pass

    task = asyncio.ensure_future(consume())
    await until(lambda: fake.steps > 3)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await until(lambda: fake.aborted == ["a"] and not fake.has_unfinished_requests())
    await eng.shutdown()


async def test_add_errors_propagate_and_leave_nothing_behind():
    eng = await started(FakeEngine())
    with pytest.raises(ValueError):
        await eng.add_requests([("ok", [1], params()), ("bad", [], params())])
    assert eng.num_waiting == 0 and eng.num_open_streams == 0
    with pytest.raises(ValueError):  # duplicate ids
        await eng.add_requests([("d", [1], params()), ("d", [1], params())])
    await eng.shutdown()


async def test_queue_limit():
    eng = await started(FakeEngine(step_delay=0.05), max_queued_requests=2)
    s1 = await eng.add_requests([("a", [1], params(50)), ("b", [1], params(50))])
    with pytest.raises(QueueFullError):
        await eng.add_request("c", [1], params())
    await s1.aclose()
    await eng.shutdown()


async def test_event_loop_stays_responsive_during_slow_steps():
    eng = await started(FakeEngine(step_delay=0.2))
    async with await eng.add_request("a", [1], params(5)):
        t0 = time.monotonic()
        for _ in range(10):
            await asyncio.sleep(0.001)
        assert time.monotonic() - t0 < 0.15
    await eng.shutdown()


async def test_step_exception_kills_engine_and_fails_streams():
    eng = await started(FakeEngine(fail_at_step=3))
    async with await eng.add_request("a", [1], params(100)) as stream:
        outs = [o async for o in stream]
    assert outs[-1].finish_reason == "error" and outs[-1].error
    assert not eng.is_alive
    with pytest.raises(EngineDeadError):
        await eng.add_request("b", [1], params())
    await eng.shutdown()


async def test_stuck_consumer_is_cut_off_without_blocking_the_loop():
    fake = FakeEngine()
    eng = await started(fake, max_stream_buffer=5, reader_stall_timeout=0.2)
    async with await eng.add_request("slow", [1], params(10_000)) as stream:
        await until(lambda: fake.aborted == ["slow"])
        outs = [o async for o in stream]
    assert 6 <= len(outs) <= 41 and outs[-1].finish_reason == "error" and outs[-1].error
    await eng.shutdown()


async def test_consumer_that_keeps_reading_is_never_cut_off_however_far_behind():
    """A full buffer is no verdict on a reader that keeps taking outputs (a loaded machine slows it down); only
    falling 8 buffers behind is."""
    fake = FakeEngine(step_delay=0.001)
    eng = await started(fake, max_stream_buffer=5, reader_stall_timeout=0.5)
    outs = []
    async with await eng.add_request("slow", [1], params(30)) as stream:
        async for out in stream:
            outs.append(out)
            await asyncio.sleep(0.02)  # twenty times slower than the engine writes
    assert len(outs) == 30 and outs[-1].finish_reason == "length" and fake.aborted == []
    async with await eng.add_request("far", [1], params(10_000)) as stream:
        await until(lambda: fake.aborted == ["far"])
        outs = [o async for o in stream]
    assert len(outs) == 41 and outs[-1].finish_reason == "error"
    await eng.shutdown()


async def test_drain_waits_for_in_flight_then_refuses():
    eng = await started(FakeEngine(step_delay=0.01))
    stream = await eng.add_request("a", [1], params(10))
    task = asyncio.ensure_future(read_all(stream))
    await eng.drain(timeout=5)
    outs = await task
    assert outs[-1].finish_reason == "length" and len(outs) == 10
    with pytest.raises(EngineDrainingError):
        await eng.add_request("b", [1], params())
    await eng.shutdown()


async def test_drain_timeout_aborts_with_error_event():
    fake = FakeEngine(step_delay=0.01)
    eng = await started(fake)
    stream = await eng.add_request("a", [1], params(100_000))
    task = asyncio.ensure_future(read_all(stream))
    await eng.drain(timeout=0.2)
    outs = await task
    assert outs[-1].finish_reason == "abort" and "shutting down" in outs[-1].error
    await until(lambda: not fake.has_unfinished_requests())
    await eng.shutdown()
