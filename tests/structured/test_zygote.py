"""The zygote (service/structured/zygote.py): workers forked on request, killed on request, and a zygote that cannot
serve is an OSError within its timeout, never a hang."""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest

from sluice.cpu import private_bytes
from sluice.service.structured.zygote import Zygote


def echo(conn) -> None:
    """A worker: send back what it reads, until EOF."""
    while True:
        try:
            conn.send(conn.recv())
        except EOFError:
            return


def test_workers_answer_and_die_when_killed():
    zygote = Zygote("tests.structured.test_zygote:echo", timeout=30)
    try:
        first, conn = zygote.spawn()
        second, other = zygote.spawn()
        assert first.pid != second.pid != zygote.pid
        conn.send({"x": 1})
        other.send("y")
        assert conn.recv() == {"x": 1} and other.recv() == "y"
        first.kill()
        assert conn.poll(5)
        with pytest.raises(EOFError):
            conn.recv()
        first.kill()  # twice: already gone is fine
        other.send("still here")
        assert other.recv() == "still here"
    finally:
        zygote.close()
    other.close()  # its worker ends on EOF


def test_a_zygote_that_cannot_serve_is_an_error_within_its_timeout():
    broken = Zygote("tests.structured.no_such_module:echo", timeout=30)
    with pytest.raises(OSError):
        broken.spawn()
    broken.close()
    stopped = Zygote("tests.structured.test_zygote:echo", timeout=0.5)
    os.kill(stopped.pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(OSError):
        stopped.spawn()
    assert time.monotonic() - started < 5
    stopped.close()  # kills and reaps a stopped zygote too


ORPHAN_SCRIPT = """
import ctypes, os
from pathlib import Path
from sluice.cpu import private_bytes
from sluice.service.structured.zygote import Zygote
from tests.support.procs import parent_of
assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER: as a container's PID 1
zygote = Zygote("tests.structured.test_zygote:echo", timeout=30)
worker, conn = zygote.spawn()
zygote.close()  # the worker is re-parented to this process
assert parent_of(worker.pid) == os.getpid()
worker.kill()
print("left" if Path(f"/proc/{worker.pid}").exists() else "reaped")
"""


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds are Linux's")
def test_a_worker_re_parented_to_the_server_is_reaped_when_killed():
    import subprocess
    import sys

    from tests.support import REPO

    done = subprocess.run([sys.executable, "-c", ORPHAN_SCRIPT], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "reaped", done.stdout


def test_the_servers_collections_do_not_copy_its_objects_into_the_zygote():
    objects = [[i] for i in range(400_000)]  # tracked containers on ~40 MB of pages, shared once forked
    zygote = Zygote("tests.structured.test_zygote:echo", timeout=30)
    try:
        before = private_bytes(zygote.pid)
        for _ in range(3):
            gc.collect()  # a full collection writes to every object it scans
        assert private_bytes(zygote.pid) - before < 8 << 20
    finally:
        zygote.close()
        gc.unfreeze()
    del objects
