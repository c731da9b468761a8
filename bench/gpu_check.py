"""Launcher for `make gpu-check` (see sluice/service/bench/gpu_check.py): runs from a bare checkout too, where
sluice is not installed, by mapping the repository's layer folders into the `sluice` package by hand."""

from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if importlib.util.find_spec("sluice") is None or importlib.util.find_spec("sluice.kvcache") is None:
    sys.path.insert(0, ROOT)
    import sluice

    sluice.__path__.append(ROOT)  # sluice.kvcache -> ROOT/kvcache, sluice.service -> ROOT/service, ...

from sluice.service.bench.gpu_check import log_engine_lines, main  # noqa: E402

if __name__ == "__main__":
    log_engine_lines()
    raise SystemExit(0 if main().get("ok") else 1)
