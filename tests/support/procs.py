"""Processes as /proc shows them: a process's parent and live children (Linux)."""

from __future__ import annotations

from pathlib import Path


def _stat(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state first, then the parent's pid)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def parent_of(pid: int) -> int:
    """The pid of `pid`'s parent."""
    return int(_stat(pid)[1])


def children(pid: int) -> list[int]:
    """The live (not zombie) child processes of `pid`."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = _stat(entry.name)
        except OSError:  # it ended while we looked
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found
