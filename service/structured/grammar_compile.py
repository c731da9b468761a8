"""CompileService: grammar compiles in child processes, bounded in time, queue length, queue wait and waiting clients.

Each worker thread owns one child process (grammar_worker.serve, forked from the zygote, zygote.py) and sends it
one constraint at a time. A compile past its time limit, or one whose every waiting client left, is ended by
killing that child (a C++ compile cannot be interrupted from a thread); the next job forks a fresh one. A job
still queued after its wait bound is failed as busy by one more thread, so a waiter's answer comes within the
queue's wait bound plus one compile's wall-clock bound. Identical constraints waiting or compiling at once share
one job. Threads (and their children) start only when the queue needs them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from sluice.scheduling.sampling_params import StructuredOutput
from sluice.service.config import GRAMMAR_STARVED_AFTER
from sluice.service.structured.grammar_checks import TOO_COMPLEX, GrammarError
from sluice.service.structured.zygote import WorkerProcess, Zygote

logger = logging.getLogger("sluice.grammar")
STARTUP_TIMEOUT = 120.0  # the first child waits for the zygote's import of xgrammar (and torch, if it lacks it)
_POLL = 0.05  # how often a running compile looks for the end of its time or of its clients


class GrammarBusyError(RuntimeError):
    """Too many distinct grammar compiles are already waiting, or this one waited too long: retry later."""


@dataclass(slots=True, eq=False)
class CompileJob:
    """One constraint being compiled, the future its waiters share, and how many still wait."""

    constraint: StructuredOutput
    future: Future = field(default_factory=Future)
    waiters: int = 1
    abandoned: bool = False
    queued_at: float = field(default_factory=time.monotonic)


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def start_zygote(replace: Zygote | None = None) -> Zygote:
    """The process's compile zygote, forked now if it has none (or only `replace`, which failed): `sluice serve`
    calls this before it starts any thread; an engine used as a library gets one on its first compile."""
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote is replace:
            if _zygote is not None:
                _zygote.close()
            _zygote = Zygote("sluice.service.structured.grammar_worker:serve", STARTUP_TIMEOUT)
        return _zygote


def _spawn() -> tuple[WorkerProcess, Connection]:
    """A worker from the zygote; from a new zygote if it died or hangs (killed or stopped from outside)."""
    zygote = start_zygote()
    try:
        return zygote.spawn()
    except OSError:
        return start_zygote(replace=zygote).spawn()


class _Worker:
    """One compile child process and its pipe; started on first use, killed when a compile must end."""

    def __init__(self, tokenizer_info_json: str):
        self._info = tokenizer_info_json
        self._process: WorkerProcess | None = None
        self._conn = None

    def start(self) -> None:
        try:
            self._process, self._conn = _spawn()
        except OSError as e:
            raise RuntimeError(f"the grammar compile process did not start: {e}") from None
        try:
            self._conn.send(self._info)
            ready = self._conn.poll(STARTUP_TIMEOUT) and self._conn.recv() == ("ready",)
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.kill()
            raise RuntimeError("the grammar compile process did not start")

    def kill(self) -> None:
        if self._conn is not None:
            self._process.kill()
            self._conn.close()
        self._process = self._conn = None

    def run(self, job: CompileJob, timeout: float) -> tuple:
        """The child's reply; ("timeout",) past `timeout` s of its CPU time (a refusal as too complex is cached: it
        must not depend on the load that slows a low-priority compile), ("starved",) past GRAMMAR_STARVED_AFTER
        times that in wall time, or ("abandoned",), after killing it; ("died",) if two children died on it."""
        reply = self._exchange(job, timeout)
        # A child killed while idle (from outside) may still be exiting when the job is sent: its death shows only
        # now. A fresh one takes the job; only a second death is the constraint's doing.
        return self._exchange(job, timeout) if reply == ("died",) else reply

    def _exchange(self, job: CompileJob, timeout: float) -> tuple:
        c = job.constraint
        if self._conn is None:
            self.start()
        try:
            self._conn.send((c.kind, c.spec, c.param))
        except OSError:
            return self._died()
        started, cpu_before = time.monotonic(), self._process.cpu_seconds()
        while not self._conn.poll(_POLL):
            waited = time.monotonic() - started
            cpu_now = self._process.cpu_seconds()
            used = waited if cpu_before is None or cpu_now is None else cpu_now - cpu_before
            if job.abandoned:
                outcome = "abandoned"
            elif used > timeout:
                outcome = "timeout"
            elif waited > timeout * GRAMMAR_STARVED_AFTER:
                outcome = "starved"
            else:
                continue
            self.kill()
            return (outcome,)
        try:
            return self._conn.recv()
        except (EOFError, OSError):  # out of memory, or killed from outside
            return self._died()

    def _died(self) -> tuple:
        self.kill()
        return ("died",)


class CompileService:
    """Runs compiles in up to `workers` child processes; `finish` turns a reply's JSON into the result. A job
    queued for more than `queue_timeout` s fails with GrammarBusyError."""

    def __init__(self, tokenizer_info_json: str, workers: int, timeout: float, queue_size: int,
                 finish: Callable[[StructuredOutput, str], object], queue_timeout: float = 10.0):
        self._info, self._timeout, self._queue_size, self._finish = tokenizer_info_json, timeout, queue_size, finish
        self._queue_timeout = queue_timeout
        self._max_threads = workers
        self._threads: list[threading.Thread] = []
        self._expiry: threading.Thread | None = None
        self._idle = 0
        self._queue: deque[CompileJob] = deque()
        self._jobs: dict[tuple[str, str], CompileJob] = {}  # queued or compiling, by constraint key
        self._cond = threading.Condition()

    def submit(self, constraint: StructuredOutput) -> CompileJob:
        """The job compiling this constraint, joined if one is already queued or running; GrammarBusyError."""
        with self._cond:
            job = self._jobs.get(constraint.key)
            if job is not None:
                job.waiters += 1
                return job
            if len(self._queue) >= self._queue_size:
                raise GrammarBusyError(f"more than {self._queue_size} grammar compiles are waiting "
                                       "(--grammar-compile-queue)")
            job = self._jobs[constraint.key] = CompileJob(constraint)
            self._queue.append(job)
            if len(self._queue) > self._idle and len(self._threads) < self._max_threads:
                thread = threading.Thread(target=self._serve, daemon=True, name="sluice-grammar-compile")
                self._threads.append(thread)
                thread.start()
            if self._expiry is None:
                self._expiry = threading.Thread(target=self._expire, daemon=True, name="sluice-grammar-queue")
                self._expiry.start()
            self._cond.notify_all()  # an idle worker, and the expiry thread if the queue was empty
            return job

    def release(self, job: CompileJob) -> None:
        """A waiter left; the last one to leave abandons the compile (dropped from the queue, or killed)."""
        with self._cond:
            job.waiters -= 1
            if job.waiters > 0 or job.future.done():
                return
            job.abandoned = True
            if self._jobs.get(job.constraint.key) is job:
                del self._jobs[job.constraint.key]
            try:
                self._queue.remove(job)
            except ValueError:  # already running: its worker sees `abandoned` and kills the compile
                return
        job.future.cancel()

    def _expire(self) -> None:
        """Fail each job still queued `queue_timeout` s after it came (the oldest first: the queue is FIFO)."""
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                job = self._queue[0]
                left = job.queued_at + self._queue_timeout - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._queue.popleft()
                if self._jobs.get(job.constraint.key) is job:
                    del self._jobs[job.constraint.key]
            c = job.constraint
            logger.warning("grammar compile for %s waited %.1f s for a worker: refused as busy", c.param,
                           self._queue_timeout)
            job.future.set_exception(GrammarBusyError(
                f"{c.param} waited more than {self._queue_timeout:g} s for a grammar compile worker "
                "(--grammar-queue-timeout); the server is busy compiling others"))

    def _serve(self) -> None:
        worker = _Worker(self._info)
        while True:
            with self._cond:
                self._idle += 1
                while not self._queue:
                    self._cond.wait()
                self._idle -= 1
                job = self._queue.popleft()
                job.future.set_running_or_notify_cancel()
            try:
                job.future.set_result(self._compile(worker, job))
            except BaseException as e:  # GrammarError, or a worker that cannot start
                job.future.set_exception(e)
            with self._cond:
                if self._jobs.get(job.constraint.key) is job:
                    del self._jobs[job.constraint.key]

    def _compile(self, worker: _Worker, job: CompileJob):
        c = job.constraint
        started = time.perf_counter()
        reply = worker.run(job, self._timeout)
        elapsed = time.perf_counter() - started
        if reply[0] == "ok":
            logger.debug("compiled %s (%d bytes) in %.3f s", c.param, len(c.spec), elapsed)
            return self._finish(c, reply[1])
        if reply[0] == "error":
            raise GrammarError(reply[1], c.param, reply[2])
        if reply[0] == "timeout":
            logger.warning("grammar compile for %s passed %.1f s: killed", c.param, self._timeout)
            raise GrammarError(f"{c.param} took more than {self._timeout:g} s of CPU time to compile "
                               "(--grammar-compile-timeout); simplify it", c.param, TOO_COMPLEX)
        if reply[0] == "starved":
            logger.warning("grammar compile for %s got too little CPU in %.1f s: killed", c.param, elapsed)
            raise GrammarBusyError(f"the server is too busy to compile {c.param} now; retry")
        if reply[0] == "died":
            raise GrammarError(f"compiling {c.param} ended its compile process (out of memory?); simplify it",
                               c.param, TOO_COMPLEX)
        raise GrammarError(f"the compile of {c.param} was abandoned by its clients", c.param)
