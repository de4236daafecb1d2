"""Finding the training worker processes of a process, from ``/proc`` (Linux): the "no orphan" checks.

A worker runs ``nodes/training/worker_entry.py`` by path, so it is told apart from any other child by that name
in its command line. A zombie (exited, not yet reaped) counts as gone.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

__all__ = ["ENTRY_NAME", "PROC_READABLE", "alive", "wait_gone", "workers_of"]

ENTRY_NAME = "worker_entry.py"
PROC_READABLE = sys.platform == "linux" and Path("/proc/self/stat").exists()


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (not a zombie)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def workers_of(parent: int) -> list[int]:
    """Pids of the live training workers whose parent is ``parent``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat(int(entry.name))
        if fields is None or fields[0] == "Z" or int(fields[1]) != parent:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if ENTRY_NAME.encode() in cmdline:
            found.append(int(entry.name))
    return found


def wait_gone(parent: int, timeout: float = 30.0) -> list[int]:
    """Wait until ``parent`` has no live worker; returns those still there after ``timeout``."""
    deadline = time.monotonic() + timeout
    left = workers_of(parent)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = workers_of(parent)
    return left
