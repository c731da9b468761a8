"""Facts of this machine every layer reads the same way: where Sluice caches what it builds and fetches, and the
CPU's model and feature flags."""

from __future__ import annotations

import os
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cache_root() -> Path:
    """$SLUICE_CACHE_DIR, else ~/.cache/sluice: models, built kernels and benchmark peers live below it."""
    return Path(os.environ.get("SLUICE_CACHE_DIR") or Path.home() / ".cache" / "sluice")


def cpu_flags_line(cpuinfo: Path = CPUINFO) -> str | None:
    """The feature flags line of /proc/cpuinfo ("flags" on x86, "Features" on Arm), or None where there is none."""
    return _first_line(_cpuinfo_lines(cpuinfo), ("flags", "Features"))


def cpu_model_line(cpuinfo: Path = CPUINFO) -> str | None:
    """The CPU's model lines of /proc/cpuinfo (name, family, model, stepping), or None where there are none."""
    lines = _cpuinfo_lines(cpuinfo)
    found = [_first_line(lines, (key,)) for key in ("model name", "cpu family", "model\t", "stepping")]
    return "; ".join(line for line in found if line) or None


def _cpuinfo_lines(cpuinfo: Path) -> list[str]:
    """/proc/cpuinfo's lines, [] where there is none."""
    try:
        return cpuinfo.read_text().splitlines()
    except OSError:
        return []


def _first_line(lines: list[str], starts: tuple[str, ...]) -> str | None:
    """The first of `lines` that starts with one of `starts`."""
    return next((line for line in lines if line.startswith(starts)), None)
