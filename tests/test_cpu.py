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
