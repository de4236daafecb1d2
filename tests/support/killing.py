"""Run a writer in a forked child and ``kill -9`` it at a random moment (the crash tests of the format)."""

from __future__ import annotations

import os
import random
import select
import signal
import time
from collections.abc import Callable
from pathlib import Path


def fork_and_kill(root: Path, run: int, child: Callable[[Path, int, int], None], rng: random.Random) -> list[str]:
    """Fork, run ``child(root, run, write_fd)`` in the child, SIGKILL it at a random moment, return its lines.

    The child writes one line per step it made durable (``"ready"`` lines are dropped). Mostly the kill waits for
    the first line and then a random 0–50 ms; one time in ten it lands during start-up.
    """
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(rfd)
            child(root, run, wfd)
        finally:
            os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as f:
        if rng.random() < 0.9:  # else kill during start-up (possibly while the cache is being created)
            select.select([f], [], [], 30)
        time.sleep(rng.uniform(0.0, 0.05))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return [x for x in f.read().decode().split() if x != "ready"]
