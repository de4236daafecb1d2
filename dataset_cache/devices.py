"""Which devices a training run uses: the ``devices`` setting read into one rank per device.

Rank 0 is always the calling process's own device (in ComfyUI, the one its models load to): the run's result is
made there, and ComfyUI's progress and Cancel live in that process. The other ranks are worker processes, one per
further device. ``cpu:N`` runs N ranks on the CPU: it exists so the same multi-process code path can be tested on a
machine without GPUs (gloo, 2 processes); it is not a way to train faster. ``+ N remote`` after the local devices
adds N ranks that join from other machines (``scripts/join-training``), one per device there.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["AUTO", "DevicePlan", "parse_devices"]

AUTO = "auto"
"""Every visible CUDA device when the home device is a CUDA device and there are several; else the home device."""


@dataclass(frozen=True)
class DevicePlan:
    """The devices of a run, rank by rank.

    Attributes:
        kind: ``"cuda"``, ``"cpu"``, or another torch device type (one rank only).
        indices: the device index of each rank (rank 0 first: the home device); for ``"cpu"``, ``0 .. N-1``.
    """

    kind: str
    indices: tuple[int, ...]
    remote: int = 0
    """Ranks that join from other machines, after the local ones (``+ N remote``)."""

    @property
    def size(self) -> int:
        """Number of ranks (1: train in this process alone, as without the setting)."""
        return len(self.indices) + self.remote

    @property
    def local(self) -> int:
        """Ranks on this machine (rank 0 and the worker processes it starts)."""
        return len(self.indices)

    def describe(self) -> str:
        """``"cuda:0, cuda:1"``, ``"2 CPU processes"`` or ``"cuda:0 and 2 ranks on other machines"``, for
        messages."""
        if self.kind == "cpu" and self.local > 1:
            here = f"{self.local} CPU processes"
        else:
            here = ", ".join(f"{self.kind}:{i}" for i in self.indices)
        if self.remote:
            return f"{here} and {self.remote} rank{'s' if self.remote > 1 else ''} on other machines"
        return here


_REMOTE = re.compile(r"^(?P<local>[^+]*?)\s*\+\s*(?P<count>[^+]*?)\s*remote\s*$", re.IGNORECASE)
MAX_REMOTE = 64
"""The most ranks ``+ N remote`` may ask for."""


def parse_devices(spec: str | Sequence[int] | None, *, home: str, home_index: int | None,
                  cuda_count: int) -> DevicePlan:
    """Read the ``devices`` setting.

    Args:
        spec: ``None``/``"auto"``/``""`` (see :data:`AUTO`); a list of CUDA device indices (``"0,1"``,
            ``"cuda:0, cuda:2"`` or a sequence of ints) that must include the home device; ``"cpu"`` or ``"cpu:N"``
            (N CPU ranks, for tests); any of these text forms followed by ``+ N remote`` (N more ranks joining
            from other machines).
        home: the device type of rank 0 (the calling process's training device).
        home_index: its index (``None``: the current CUDA device, given as 0).
        cuda_count: how many CUDA devices this process sees.

    Raises:
        ValueError: a malformed list, an index past the visible devices, a repeated index, a list without the home
            device, CUDA indices on a non-CUDA home, ``cpu:N`` on a GPU home or with N past the CPU count.
    """
    if isinstance(spec, str) and (found := _REMOTE.match(spec.strip())):
        count = found["count"]
        if not count.isdigit() or not 1 <= int(count) <= MAX_REMOTE:
            raise ValueError(f"devices {spec!r}: write '+ N remote' with N from 1 to {MAX_REMOTE}, the number of "
                             "ranks that join from other machines (e.g. '0 + 2 remote')")
        local = parse_devices(found["local"], home=home, home_index=home_index, cuda_count=cuda_count)
        if local.kind not in ("cuda", "cpu"):
            raise ValueError(f"devices {spec!r}: this ComfyUI trains on {local.kind}; ranks on other machines "
                             "join CUDA or CPU runs only")
        return DevicePlan(local.kind, local.indices, int(count))
    if isinstance(spec, str) and "+" in spec:
        raise ValueError(f"devices {spec!r}: after '+', write 'N remote' (N ranks joining from other machines, "
                         "e.g. '0 + 2 remote')")
    here = home_index or 0
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", AUTO)):
        if home == "cuda" and cuda_count > 1:
            return DevicePlan("cuda", (here, *[i for i in range(cuda_count) if i != here]))
        return DevicePlan(home, (here,))
    if isinstance(spec, str) and spec.strip().lower().startswith("cpu"):
        return _cpu_plan(spec.strip().lower(), home)
    indices = _cuda_indices(spec)
    if home != "cuda":
        raise ValueError(f"devices {_show(spec)}: this ComfyUI trains on {home}, not on CUDA devices; leave devices "
                         "at 'auto' (or 'cpu:N' on a ComfyUI started with --cpu, for tests)")
    bad = [i for i in indices if not 0 <= i < cuda_count]
    if bad:
        raise ValueError(f"devices {_show(spec)}: no CUDA device {bad[0]} (this process sees {cuda_count}: "
                         f"0..{cuda_count - 1}); pick from those or use 'auto'")
    if len(set(indices)) != len(indices):
        raise ValueError(f"devices {_show(spec)}: a device is listed twice; list each once")
    if here not in indices:
        raise ValueError(f"devices {_show(spec)}: rank 0 trains in ComfyUI's own process, on its device cuda:{here}, "
                         f"so the list must include {here} (or start ComfyUI with --cuda-device to move it)")
    return DevicePlan("cuda", (here, *[i for i in indices if i != here]))


def _cpu_plan(text: str, home: str) -> DevicePlan:
    count_text = text[3:].lstrip(":").strip() or "1"
    try:
        count = int(count_text)
    except ValueError:
        raise ValueError(f"devices {text!r}: write cpu:N with N a whole number of CPU processes (for tests)") from None
    cores = os.cpu_count() or 1
    if not 1 <= count <= cores:
        raise ValueError(f"devices {text!r}: cpu:N needs 1 <= N <= {cores} (this machine's CPU cores)")
    if home != "cpu" and count > 1:
        raise ValueError(f"devices {text!r}: cpu:N is for testing on a ComfyUI started with --cpu; this one trains "
                         f"on {home}: use 'auto' or a list of CUDA devices")
    return DevicePlan("cpu", tuple(range(count)))


def _cuda_indices(spec: str | Sequence[int]) -> list[int]:
    if not isinstance(spec, str):
        if any(isinstance(i, bool) or not isinstance(i, int) for i in spec):
            raise ValueError(f"devices {_show(spec)}: give CUDA device indices as whole numbers")
        return [int(i) for i in spec]
    out = []
    for part in spec.split(","):
        item = part.strip().lower().removeprefix("cuda:")
        if not item.isdigit():
            raise ValueError(f"devices {spec!r}: {part.strip()!r} is not a CUDA device index; write 'auto', a list "
                             "such as '0,1', or 'cpu:2' (tests)")
        out.append(int(item))
    return out


def _show(spec: str | Sequence[int]) -> str:
    return repr(spec) if isinstance(spec, str) else repr(list(spec))
