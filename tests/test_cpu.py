import os

import pytest

from sluice.cpu import available_cpus


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


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="Linux /proc accounting")
def test_helpers_count_a_childs_own_pages_and_not_the_pages_it_shares():
    import subprocess
    import sys
    import time

    from sluice.cpu import descendants, helpers_private_bytes, private_bytes, resident_bytes, tree_resident_bytes

    # A child of its own with 64 MiB written: all of it is the child's alone, and counted as the server's.
    code = "import sys, time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); print(1, flush=True); " \
           "time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
        assert child.pid in descendants() and private_bytes(child.pid) >= 64 << 20
        assert helpers_private_bytes() >= private_bytes(child.pid)
        assert tree_resident_bytes() >= resident_bytes() + (64 << 20)
    finally:
        child.kill()
        child.wait()
    # A forked child that writes nothing shares its parent's pages: they are not counted again.
    shared = bytearray(64 << 20)
    shared[::4096] = b"y" * len(shared[::4096])
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    try:
        time.sleep(0.2)
        assert pid in descendants() and resident_bytes(pid) >= 64 << 20  # its resident set holds the shared pages
        assert private_bytes(pid) < 16 << 20  # its private memory does not
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert pid not in descendants() and resident_bytes(pid) == private_bytes(pid) == 0


def test_release_freed_memory_runs_here():
    from sluice.cpu import release_freed_memory

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


# ---- niceness: relative to the server's own ---------------------------------------------------------------------

_NICE_PROBE = """
import json, os, sys, threading
from sluice.cpu import COMPILE_NICENESS, lower_priority, thread_niceness

seen = {"main": thread_niceness()}

def pool_thread():  # as the preparation pool's initializer runs
    seen["returned"] = lower_priority()
    seen["thread"] = thread_niceness()

t = threading.Thread(target=pool_thread)
t.start()
t.join()
seen["main_after"] = thread_niceness()
# The compile zygote lowers itself, then forks workers that lower themselves to COMPILE_NICENESS: still relative
# to the server's level, not to the zygote's.
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    lower_priority()
    child = os.fork()
    if child == 0:
        os.write(w, str(lower_priority(COMPILE_NICENESS)).encode())
        os._exit(0)
    os.waitpid(child, 0)
    os._exit(0)
os.waitpid(pid, 0)
os.close(w)
seen["worker"] = int(os.read(r, 16))
print(json.dumps(seen))
"""


def _niceness_under(start: int) -> dict:
    import json
    import shutil
    import subprocess
    import sys

    if shutil.which("nice") is None or not hasattr(os, "getpriority"):
        pytest.skip("needs Linux nice values")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    out = subprocess.run(["nice", "-n", str(start - base), sys.executable, "-c", _NICE_PROBE], capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_background_work_is_lowered_relative_to_the_server():
    from sluice.cpu import BACKGROUND_NICENESS, COMPILE_NICENESS

    if os.getpriority(os.PRIO_PROCESS, 0) > 5:
        pytest.skip("the test process already runs above nice 5")
    seen = _niceness_under(5)  # a server started at nice 5 still gets its separation
    assert seen["main"] == 5 and seen["main_after"] == 5  # only the pool's thread is lowered
    assert seen["thread"] == seen["returned"] == 5 + BACKGROUND_NICENESS == 10
    assert seen["worker"] == 5 + COMPILE_NICENESS == 15  # not 5 + 5 + 10


def test_a_server_near_the_bottom_is_cut_at_19_not_refused():
    seen = _niceness_under(17)  # the absolute nice 5 would have needed raising the priority, and failed silently
    assert seen["main"] == 17
    assert seen["thread"] == seen["returned"] == seen["worker"] == 19


def test_a_thread_already_lower_stays_where_it_is():
    import threading

    from sluice.cpu import lower_priority, thread_niceness

    seen = {}

    def work():
        here = thread_niceness()
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, here + 8))
        seen["after"] = lower_priority(5, base=here)  # below its own level already: left alone, no raise
        seen["want"] = min(19, here + 8)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen["after"] == seen["want"]
