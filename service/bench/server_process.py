"""One server process for a benchmark: started on a free loopback port, waited for, measured, stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from sluice.cpu import tree_resident_bytes
from sluice.machine import cache_root
from sluice.service.bench.soak import free_port


def neutral_cwd() -> str:
    """An empty directory for servers to start in: `python -m` puts the working directory first on sys.path, so a
    baseline commit's interpreter started in this checkout would import this checkout's root package, not its own
    (and one started in a directory of loose .py files, any of them)."""
    path = cache_root() / "bench" / "cwd"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


class ServerProcess:
    """`cmd` (any OpenAI-style server taking --host/--port) on a free port, ready once `ready_path` answers 200;
    stopped (SIGTERM, then kill) on leaving the `with`. Its output goes to `log`, or nowhere."""

    def __init__(self, cmd: list[str], ready_path: str, log: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        args = [*cmd, "--host", "127.0.0.1", "--port", str(self.port)]
        environ = {**os.environ, **env} if env else None  # `env`: variables set on top of this process's
        if log is None:
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=neutral_cwd(),
                                         env=environ)
        else:
            with open(log, "w") as out:  # the child keeps its own copy of the descriptor
                self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=neutral_cwd(),
                                             env=environ)
        try:
            wait_ready(self.base + ready_path, self.proc)
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *_) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM, then a kill after 30 s."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def rss_mib(self) -> float:
        """What the server holds now: its resident set and its child processes' private memory (sluice.cpu)."""
        return tree_resident_bytes(self.proc.pid) / 2**20

    def peak_rss_mib(self) -> float:
        """The server process's largest resident set so far (VmHWM: the model's load included)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return 0.0


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    """Poll `url` until it answers 200; raise if the process exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(map(str, proc.args))}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout:.0f}s")
