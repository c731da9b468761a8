"""Zygote: a child forked from the server before it starts any thread, which forks worker processes on request.

multiprocessing's fork server execs a fresh interpreter that must import the workers' modules (xgrammar, and
through it torch and transformers) before its first child: seconds of a core for each server, paid by the first
constrained request. A fork of the server taken at start-up already holds what the server had imported, and a
worker forked from it costs one fork. Forked before the engine's threads exist, it holds no lock another thread
could have held. It imports the workers' modules on its first request (a server never asked for a worker never
pays), lets the kernel reap its children, and exits when the server's end of its socket closes.
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import socket
import threading
from multiprocessing.connection import Connection, Pipe
from pathlib import Path

from sluice.cpu import lower_priority

_PID_BYTES = 8
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # the unit of /proc/PID/stat's times


class WorkerProcess:
    """A worker forked by the zygote; killed through a pidfd where Linux has them, so a worker that already died
    and was reaped cannot have its pid reused under the kill."""

    def __init__(self, pid: int):
        self.pid = pid
        self._pidfd: int | None = None  # None: no pidfds here (not Linux, or before 5.3); signalled by pid
        self._gone = False
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # it died at once: nothing to kill
            self._gone = True
        except (AttributeError, OSError):
            pass

    def cpu_seconds(self) -> float | None:
        """The user and system CPU time it has used; None where /proc cannot say (not Linux, or it is gone)."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
        except (OSError, IndexError, ValueError):
            return None

    def kill(self) -> None:
        """SIGKILL it; one already gone is fine."""
        if self._gone:
            return
        self._gone = True
        try:
            if self._pidfd is None:
                os.kill(self.pid, signal.SIGKILL)
            else:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                # A worker whose zygote was replaced is re-parented to init, which is this server when it runs
                # as a container's PID 1: reap it then, or it stays a zombie. Anyone else's child: ECHILD.
                os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED)
        except (ProcessLookupError, ChildProcessError):
            pass
        finally:
            if self._pidfd is not None:
                os.close(self._pidfd)


class Zygote:
    """The server's handle on its zygote: `spawn()` forks a worker there and returns it with a pipe to it."""

    def __init__(self, target: str, timeout: float):
        """Fork the zygote now; each worker runs `target` ("module:function") with its end of the pipe. `timeout`:
        seconds a spawn may wait for the zygote (its first one includes the import of `target`'s module)."""
        ours, theirs = socket.socketpair()
        # Every later collection in the server would write to the header of each object alive now, and so copy
        # its page into the zygote (a copy on write): 30-50 MB for a loaded server. Frozen, they are never scanned.
        gc.collect()
        gc.freeze()
        self.pid = os.fork()
        if self.pid == 0:
            ours.close()
            code = 1
            try:
                _serve(theirs, target)
                code = 0
            finally:
                os._exit(code)
        theirs.close()
        ours.settimeout(timeout)
        self._sock = ours
        self._lock = threading.Lock()

    def spawn(self) -> tuple[WorkerProcess, Connection]:
        """A new worker and the server's end of its pipe; OSError when the zygote is gone or does not answer."""
        ours, theirs = Pipe()
        try:
            with self._lock:
                socket.send_fds(self._sock, [b"+"], [theirs.fileno()])
                reply = self._sock.recv(_PID_BYTES, socket.MSG_WAITALL)
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        if len(reply) != _PID_BYTES:
            ours.close()
            raise OSError("the zygote ended")
        return WorkerProcess(int.from_bytes(reply, "little")), ours

    def close(self) -> None:
        """Kill and reap the zygote; its workers live on until their pipes close."""
        self._sock.close()
        try:
            os.kill(self.pid, signal.SIGKILL)  # our child, unreaped: its pid cannot have been reused
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _serve(sock: socket.socket, target: str) -> None:
    # Ctrl-C reaches the whole process group: the server decides when its children end (they see EOF).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers; the server kills them
    lower_priority()  # its import of the workers' modules is a request's work, beside the step's threads
    run = None
    while True:
        message, fds, _, _ = socket.recv_fds(sock, 1, 1)
        if not message:
            return
        if run is None:
            module, name = target.split(":")
            run = getattr(importlib.import_module(module), name)
        pid = os.fork()
        if pid == 0:
            sock.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            code = 1
            try:
                run(Connection(fds[0]))
                code = 0
            finally:
                os._exit(code)
        os.close(fds[0])
        sock.sendall(pid.to_bytes(_PID_BYTES, "little"))
