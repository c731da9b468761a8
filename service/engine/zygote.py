"""Zygote: a child forked from the server before it starts any thread, which forks worker processes on request.

multiprocessing's fork server execs a fresh interpreter that must import the workers' modules (xgrammar, and
through it torch and transformers) before its first child: seconds of a core for each server, paid by the first
constrained request. A fork of the server taken at start-up already holds what the server had imported, and a
worker forked from it costs one fork. Forked before the engine's threads exist, it holds no lock another thread
could have held. It imports the workers' modules on its first request (a server never asked for a worker never
pays), lets the kernel reap its children, and exits when the server's end of its socket closes.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import threading
from multiprocessing.connection import Connection, Pipe

_PID_BYTES = 8


class Zygote:
    """The server's handle on its zygote: `spawn()` forks a worker there and returns its pid and a pipe to it."""

    def __init__(self, target: str):
        """Fork the zygote now; each worker runs `target` ("module:function") with its end of the pipe."""
        ours, theirs = socket.socketpair()
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
        self._sock = ours
        self._lock = threading.Lock()

    def spawn(self) -> tuple[int, Connection]:
        """A new worker's pid and the server's end of its pipe; OSError when the zygote is gone."""
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
        return int.from_bytes(reply, "little"), ours

    def close(self) -> None:
        """End the zygote (it exits on the closed socket) and reap it; its workers end when their pipes close."""
        self._sock.close()
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


def kill(pid: int) -> None:
    """SIGKILL a worker; one already gone is fine (the zygote reaped it)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _serve(sock: socket.socket, target: str) -> None:
    # Ctrl-C reaches the whole process group: the server decides when its children end (they see EOF).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers; the server kills them by pid
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
