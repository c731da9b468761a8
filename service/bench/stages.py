"""Stages of a one-shot check run (`make gpu-check`): each in its own try, under its own time budget, from a fresh
compile state, with its traceback and torch's recompile reasons kept, and the report written after every stage.

A device run is short and cannot be repeated at will, so one stage failing, overrunning or recompiling must
still leave every other stage's figures, and enough to tell why, in the JSON.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

MAX_RECOMPILE_LINES = 40


class StageTimeout(Exception):
    """A stage ran past its budget."""


@dataclass(slots=True)
class Stage:
    """One named check and the seconds it may take."""

    name: str
    run: Callable[[], dict]
    budget_s: float


class _RecompileLog(logging.Handler):
    """Collects torch's recompile and graph-break reasons (its `recompiles`/`graph_breaks` log artifacts)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.lines) < MAX_RECOMPILE_LINES:
            self.lines.append(record.getMessage()[:500])


def reset_compile_state() -> None:
    """Forget every compiled graph, so a stage's compile count and time are its own."""
    torch.compiler.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fail_loudly_on_recompile_limit() -> None:
    """Past dynamo's recompile limit a function silently runs uncompiled: make that an error instead."""
    config = torch._dynamo.config
    if hasattr(config, "fail_on_recompile_limit_hit"):
        config.fail_on_recompile_limit_hit = True


def run_stage(stage: Stage) -> dict:
    """The stage's report; on an exception or past its budget, what went wrong instead (never raises)."""
    reset_compile_state()
    recompiles = _RecompileLog()
    torch._logging.set_logs(recompiles=True, graph_breaks=True)
    artifact_logs = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
                     if name.endswith(("__recompiles", "__graph_breaks"))]
    for log in artifact_logs:
        log.addHandler(recompiles)
    alarm = threading.current_thread() is threading.main_thread() and math.isfinite(stage.budget_s)
    if alarm:  # the budget interrupts Python between two calls; a running kernel finishes first
        previous = signal.signal(signal.SIGALRM, _raise_timeout)
        signal.setitimer(signal.ITIMER_REAL, stage.budget_s)
    graphs_before = _unique_graphs()
    start = time.perf_counter()
    try:
        report = stage.run()
    except StageTimeout:
        report = {"error": f"over its budget of {stage.budget_s:.0f} s", "traceback": traceback.format_exc()[-4000:]}
    except Exception as e:  # one stage failing must not lose the others' figures
        report = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]}
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        for log in artifact_logs:
            log.removeHandler(recompiles)
        torch._logging.set_logs()
    report = report if isinstance(report, dict) else {"result": report}
    report["seconds"] = round(time.perf_counter() - start, 1)
    report["graphs_compiled"] = _unique_graphs() - graphs_before
    if recompiles.lines:
        report["recompiles"] = recompiles.lines
    return report


def _unique_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _raise_timeout(signum, frame) -> None:
    raise StageTimeout()


def run_stages(stages: list[Stage], report: dict, write: Callable[[dict], None]) -> dict:
    """Every stage in order into `report[name]`, `write(report)` after each; the report."""
    fail_loudly_on_recompile_limit()
    start = time.perf_counter()
    for stage in stages:
        report[stage.name] = run_stage(stage)
        report["elapsed_s"] = round(time.perf_counter() - start, 1)
        write(report)
        print(f"gpu-check: {stage.name} done in {report[stage.name]['seconds']} s"
              + (f" ({report[stage.name]['error']})" if "error" in report[stage.name] else ""), flush=True)
    return report
