import os

from sluice.service.engine.cpu import available_cpus


def test_cgroup_quota_caps_the_thread_count(tmp_path):
    cores = len(os.sched_getaffinity(0))
    limit = tmp_path / "cpu.max"
    limit.write_text("max 100000\n")
    assert available_cpus(limit) == cores
    limit.write_text("50000 100000\n")  # half a core still gets one thread
    assert available_cpus(limit) == 1
    limit.write_text(f"{(cores + 8) * 100000} 100000\n")  # a quota above the affinity mask changes nothing
    assert available_cpus(limit) == cores
    assert available_cpus(tmp_path / "missing") == cores


def test_release_freed_memory_runs_here():
    from sluice.service.engine.cpu import release_freed_memory

    blocks = [bytearray(1 << 20) for _ in range(64)]
    del blocks
    assert release_freed_memory() in (True, False)  # never raises; True on glibc
    import platform

    if platform.libc_ver()[0] == "glibc":
        assert release_freed_memory() is True


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_start(tmp_path):
    import os
    import time

    from sluice.native import wait_for_build_lock

    lock = tmp_path / "lock"
    wait_for_build_lock(lock)  # no lock: nothing to wait for
    lock.touch()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    wait_for_build_lock(lock, stale_after=600)
    assert not lock.exists()
    lock.touch()  # a fresh lock: a builder is at work, so it is waited on until it goes
    started = time.monotonic()
    wait_for_build_lock(lock, stale_after=0.3, poll=0.05)
    assert 0.25 < time.monotonic() - started < 5 and not lock.exists()
