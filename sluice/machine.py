"""Facts of this machine every layer reads the same way: where Sluice caches what it builds and fetches, and the
CPU's feature flags."""

from __future__ import annotations

import os
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cache_root() -> Path:
    """$SLUICE_CACHE_DIR, else ~/.cache/sluice: models, built kernels and benchmark peers live below it."""
    return Path(os.environ.get("SLUICE_CACHE_DIR") or Path.home() / ".cache" / "sluice")


def cpu_flags_line(cpuinfo: Path = CPUINFO) -> str | None:
    """The feature flags line of /proc/cpuinfo ("flags" on x86, "Features" on Arm), or None where there is none."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return None
