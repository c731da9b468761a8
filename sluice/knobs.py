"""`knob`: how every layer's config dataclass declares a field that `sluice serve` exposes as a flag.

It sits at the package root so that the lowest layer (`sluice.kvcache`) can use it as well as the highest.
"""

from __future__ import annotations

from dataclasses import field


def knob(default, help: str, **extra):
    """A config field whose help text the CLI turns into a flag (`--field-name`, env `SLUICE_FIELD_NAME`)."""
    return field(default=default, metadata={"help": help, **extra})
