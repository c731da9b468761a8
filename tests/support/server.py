"""The suite's one way to run `sluice serve` in a test: a subprocess on a tiny model and a free loopback port."""

from __future__ import annotations

import asyncio
import atexit
import json
import multiprocessing
import multiprocessing.util  # registers its exit handler now, so that _kill_forgotten_servers runs before it
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from sluice.service.bench.soak import free_port
from tests.support import REPO as ROOT

MODEL = "tiny"  # the served name of the tiny test model

# What a `sluice serve` process imports before it answers (torch, transformers, aiohttp, xgrammar and Sluice's
# modules): ~3 s of a core, paid by each of the ~25 servers a run starts. Servers fork from one process per pytest
# process that imported them once (multiprocessing's fork server), so each pays only its own model load. Not a fork
# of the test process itself: that one has run torch's thread pool, which a forked child cannot use.
PRELOAD = ["sluice.service.cli", "sluice.service.bench.soak", "sluice.service.api.api_server",
           "sluice.service.engine.async_engine", "sluice.service.executor.model_runner",
           "sluice.service.executor.kv_sizing", "sluice.service.executor.weight_prep",
           "sluice.service.structured.grammar_worker", "transformers",
           "transformers.configuration_utils", "transformers.tokenization_utils_base",
           "transformers.utils.type_validators", "torch.utils.cpp_extension", "uvloop", "xgrammar",
           "tests.support.fault_serve"]


def start_fork_server() -> None:
    """Start this process's fork server now, with PRELOAD, so its imports overlap collection (conftest calls it);
    the product's grammar compiles in this process use the same one, whose preload covers theirs."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    from multiprocessing import forkserver

    forkserver.ensure_running()


def _serve_in_fork(args: list[str], env: dict, log_path: str, faults: str) -> None:
    """The forked child: the environment, output and working directory a subprocess would get, `faults` (a
    tests/support/faults.py spec, or empty) installed on its engines, then the CLI."""
    os.environ.clear()
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout.reconfigure(line_buffering=True)
    os.chdir(ROOT)
    if faults:
        from tests.support.fault_serve import install_on_every_engine

        install_on_every_engine(faults)
    from sluice.service.cli import main

    sys.exit(main(args))


class ForkedServe:
    """A `sluice serve` forked from the fork server, with the subprocess.Popen methods the tests use."""

    def __init__(self, args: list[str], env: dict, log_path: Path, faults: str):
        self.process = multiprocessing.get_context("forkserver").Process(
            target=_serve_in_fork, args=(args, env, str(log_path), faults), name="sluice-serve")
        self.process.start()
        self.pid = self.process.pid
        _forked.add(self)

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode  # -N after signal N, as Popen says

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired("sluice serve", timeout)
        _forked.discard(self)
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_forked: set[ForkedServe] = set()


@atexit.register
def _kill_forgotten_servers() -> None:
    # multiprocessing joins every live child at exit: a server a crashed test left running would hang the worker.
    for served in list(_forked):
        served.kill()


class Server:
    """`sluice serve` on a tiny model and a loopback port; `env` adds environment variables,
    `faults` (a tests/support/faults.py spec) installs those on its engine (tests/support/fault_serve.py), `bare`
    starts it through tests/support/bare_serve.py."""

    def __init__(self, model_dir: str, log_dir: Path, *flags: str, env: dict | None = None, port: int = 0,
                 name: str = "sluice", faults: str = "", bare: bool = False):
        self.log_dir, self.name, self.own_port = Path(log_dir), name, not port
        full = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_CACHE_DIR"}
        full.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", **(env or {}))
        self.faults, self.bare, self.env = faults, bare, full
        self.cmd = ["serve", "--model", model_dir, "--served-model-name", MODEL,
                    "--host", "127.0.0.1", "--device", "cpu", "--block-size", "16",
                    "--dtype", "float32", *flags]  # fp32 even where --dtype auto would pick bf16; flags may override
        self.port_at = self.cmd.index("--host")  # where start() puts --port, before the flags that may override
        self.start(port or free_port())

    def start(self, port: int) -> None:
        """Launch the process on `port`."""
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.log_path = self.log_dir / f"{self.name}-{port}-{time.monotonic_ns()}.log"
        cmd = [*self.cmd[:self.port_at], "--port", str(port), *self.cmd[self.port_at:]]
        if not self.bare:
            self.log_path.touch()
            self.proc: ForkedServe | subprocess.Popen = ForkedServe(cmd, self.env, self.log_path, self.faults)
            return
        # as on a bare GPU image (no orjson, xgrammar, gguf, jsonschema_rs or ninja): a fresh interpreter, since
        # the fork server has them imported
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.bare_serve", *cmd], cwd=ROOT,
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                # Another process (a second pytest worker's server) took the free port between the pick and
                # the bind: start again on a new one, where the test did not ask for this port.
                if self.own_port and "address already in use" in self.log().lower():
                    self.start(free_port())
                    continue
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()[-4000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
            return json.loads(r.read())


class ServerPool:
    """The session's shared `sluice serve` processes: one per distinct (model, flags), started on first use and
    stopped when the session ends. Only for tests that leave a server as they found it: they neither stop nor
    kill it, and read its counters as deltas, never as a fresh server's values."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.servers: dict[tuple, Server] = {}

    def get(self, model_dir: str, *flags: str) -> Server:
        """The ready server for these flags, started now if no test has asked for it yet."""
        key = (str(model_dir), flags)
        if key not in self.servers:
            self.servers[key] = Server(model_dir, self.log_dir, *flags, name="shared").wait_ready()
        srv = self.servers[key]
        assert srv.proc.poll() is None, f"a test stopped the shared server {flags}:\n{srv.log()[-4000:]}"
        return srv

    def close(self) -> None:
        """Stop them all; each must exit cleanly and log no traceback."""
        bad = [f"{srv.log_path}: exit {code}" for srv in self.servers.values()
               if (code := srv.stop()) != 0 or "Traceback" in srv.log()]
        assert not bad, "shared servers ended badly:\n" + "\n".join(bad)


def is_idle(h: dict) -> bool:
    """Nothing queued, running, swapped or streaming; every device and host block free."""
    return (h["running"] == h["waiting"] == h["swapped"] == h["open_streams"] == 0
            and h["kv_free_blocks"] == h["kv_total_blocks"]
            and h["kv_free_host_blocks"] == h["kv_total_host_blocks"])


async def wait_idle(srv: Server, timeout: float = 20) -> dict:
    """Poll /health until idle; fail with the last figures."""
    deadline = time.monotonic() + timeout
    while True:
        h = await asyncio.to_thread(srv.health)
        if is_idle(h):
            return h
        assert time.monotonic() < deadline, f"engine not idle: {h}"
        await asyncio.sleep(0.05)
