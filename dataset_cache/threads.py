"""Thread counts sized from the CPUs this process may really use.

``os.cpu_count()`` reports the machine's CPUs, not the ones a container, ``taskset`` or a job scheduler grants
this process; sizing pools from it oversubscribes small allocations and has crashed trainers on one-CPU
machines. Every pool in this library asks :func:`resolve_threads` instead.
"""

from __future__ import annotations

import logging
import os

__all__ = ["available_cpus", "resolve_threads"]

log = logging.getLogger("dataset_cache.threads")


def available_cpus() -> int:
    """Return the number of CPUs this process may run on (at least 1)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        n = os.cpu_count() or 1
    return max(1, n)


def resolve_threads(requested: int | None, *, purpose: str, per_cpu: float = 1.0, maximum: int = 32) -> int:
    """Return a usable thread count for ``purpose`` (e.g. ``"loader threads"``).

    Args:
        requested: what the user asked for; ``None`` or ``0`` means "choose for me".
        purpose: named in the warning when a request is clamped.
        per_cpu: threads per available CPU when choosing automatically (I/O-bound pools may exceed 1).
        maximum: hard upper bound, whatever was requested.

    Returns:
        ``requested`` clamped to ``[1, min(maximum, ceil(available_cpus() * max(per_cpu, 1)))]``; a clamped
        request is logged as a warning, never an error, so a workflow made on a big machine still runs on a small one.
    """
    cpus = available_cpus()
    ceiling = max(1, min(maximum, int(cpus * max(per_cpu, 1.0) + 0.999)))
    if requested is None or requested <= 0:
        return max(1, min(ceiling, int(cpus * per_cpu) or 1))
    if requested > ceiling:
        log.warning(
            "%s: %d requested but this process may use %d CPU(s); using %d", purpose, requested, cpus, ceiling
        )
        return ceiling
    return int(requested)
