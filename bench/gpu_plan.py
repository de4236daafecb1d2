"""What ``scripts/bench-gpu`` runs and in which order, and the time budget that decides what still fits.

Plain data and arithmetic (no torch, no ComfyUI), so the unit tests check the plan, ``--only`` and the budget.

Order: the four required families (SD1.5, SDXL, Flux-dev, WAN 2.1 1.3B), each at batch 1 and its batch ≥ 2, three
arms side by side (bound, ours, built-in); then Encode Dataset; then the memory-capped arms of #25 and the multi-GPU
arms of #26 (present, skipped with one line where this checkout's trainer lacks the setting or the machine has one
GPU); then Qwen-Image and Lumina 2 where time allows. Each arm's cost is estimated (H100 step times of the first run,
scaled by how the arms measured so far compared with their estimates) and an arm that would not fit before the
deadline, less what the later required sections reserve, is skipped with its reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ArmPlan", "Budget", "BATCHES", "REQUIRED", "EXTRA", "CAPS", "plan_family", "plan_caps", "plan_devices",
           "matches", "choose_depth"]

REQUIRED = ("sd15", "sdxl", "flux", "wan21")
EXTRA = ("lumina2", "qwen_image")
BATCHES: dict[str, tuple[int, ...]] = {"sd15": (1, 8), "sdxl": (1, 4), "flux": (1, 2), "wan21": (1,),
                                       "lumina2": (1, 2), "qwen_image": (1,)}
"""Batch 1 and the batch ≥ 2 of each family (gpu-notes: SD1.5 512² b8, SDXL 1024² b4, Flux 1024² b1/b2, WAN 33 frames
480×832 b1)."""
EST_STEP_S: dict[tuple[str, int], float] = {
    ("sd15", 1): 0.12, ("sd15", 8): 0.55, ("sdxl", 1): 0.4, ("sdxl", 4): 1.3, ("flux", 1): 1.25, ("flux", 2): 2.0,
    ("wan21", 1): 1.0, ("lumina2", 1): 0.6, ("lumina2", 2): 1.0, ("qwen_image", 1): 2.5}
"""Seconds per step expected on one H100 (the first run's H200 medians × 1.1, bound arm; guesses where none)."""
BUILTIN_FACTOR = 1.8
"""The built-in's step at batch ≥ 2 against the bound (it runs B conditionings × B rows: 1.3–1.9× measured)."""
DEPTH1_PEAK_GIB: dict[tuple[str, int], float] = {
    ("sd15", 1): 8.0, ("sd15", 8): 79.6, ("sdxl", 1): 16.0, ("sdxl", 4): float("inf"), ("wan21", 1): 54.5}
"""Largest peak of the three arms at ``checkpoint_depth`` 1 on the first run (built-in included; inf: out of memory
on 141 GB); a family/batch not listed is taken not to fit (Flux, Lumina 2, Qwen-Image)."""
CAPS: tuple[tuple[str, int, float | None], ...] = (
    ("sdxl", 1, None), ("sdxl", 1, 8.0), ("flux", 1, None), ("flux", 1, 24.0), ("flux", 1, 12.0),
    ("flux_fp8", 1, None), ("flux_fp8", 1, 12.0), ("wan21", 1, None), ("wan21", 1, 12.0))
"""#25's targets: (family, batch, device cap in GB; None = the uncapped reference), memory plan ``auto``;
``flux_fp8`` is Flux-dev with its weights stored in fp8 e4m3fn."""


@dataclass(frozen=True)
class ArmPlan:
    """One arm to run: its id (``family/bB/arm``, ``cap/family-12/ours``, ``devices/family-N/ours``) and settings."""

    id: str
    family: str
    batch: int
    arm: str
    depth: int
    depth_note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    cap_gib: float | None = None
    est_step_s: float = 1.0
    group: str = "main"


def choose_depth(family: str, batch: int, device_gib: float, forced: int | None = None) -> tuple[int, str]:
    """``checkpoint_depth`` for all three arms of a family/batch, and why: 1 (ComfyUI's default) where the first run's
    depth-1 peak fits 90% of this device, else 2 (per block; ComfyUI counts the model itself as depth 1)."""
    if forced is not None:
        return forced, "set by --depth"
    peak = DEPTH1_PEAK_GIB.get((family, batch), float("inf"))
    if peak < 0.9 * device_gib:
        return 1, ""
    known = f"{peak:.1f} GiB on the first run" if peak != float("inf") else "out of memory on the first run"
    return 2, f"depth 1 would not fit ({known})"


def plan_family(family: str, device_gib: float, batches: tuple[int, ...] | None = None,
                depth: int | None = None) -> list[ArmPlan]:
    """The three arms of ``family`` at each batch: bound, ours, built-in (side by side, same depth)."""
    arms = []
    group = "main" if family in REQUIRED else "extra"
    for batch in batches or BATCHES[family]:
        d, note = choose_depth(family, batch, device_gib, depth)
        est = EST_STEP_S.get((family, batch), 1.0)
        for arm in ("bound", "ours", "builtin"):
            factor = BUILTIN_FACTOR if arm == "builtin" and batch > 1 else 1.0
            arms.append(ArmPlan(f"{family}/b{batch}/{arm}", family, batch, arm, d, note, est_step_s=est * factor,
                                group=group))
    return arms


def plan_caps() -> list[ArmPlan]:
    """#25's memory-capped arms: ours with the memory plan ``auto`` under each cap (and uncapped, the reference)."""
    arms = []
    for family, batch, cap in CAPS:
        tag = f"{cap:g}" if cap is not None else "none"
        arms.append(ArmPlan(f"cap/{family}-{tag}/ours", family, batch, "ours", 1, "the memory plan decides",
                            extra={"memory": "auto"}, cap_gib=cap,
                            est_step_s=EST_STEP_S.get((family, batch), 1.0) * 1.3, group="cap"))
    return arms


def plan_devices(count: int) -> list[ArmPlan]:
    """#26's scaling arms: ours on every GPU (``devices`` auto) at each required family's batch ≥ 2."""
    arms = []
    for family in REQUIRED:
        batch = BATCHES[family][-1]
        arms.append(ArmPlan(f"devices/{family}-{count}/ours", family, batch, "ours", 2, "",
                            extra={"devices": "auto"}, est_step_s=EST_STEP_S.get((family, batch), 1.0),
                            group="devices"))
    return arms


def matches(arm_id: str, patterns: list[str]) -> bool:
    """``--only``: each pattern is ``/``-separated parts that must all be parts of the id (``flux``, ``flux/ours``,
    ``b2``, ``encode``, ``cap/flux-12``); no pattern selects everything."""
    if not patterns:
        return True
    parts = set(arm_id.split("/"))
    for pattern in patterns:
        wanted = [p for p in pattern.split("/") if p]
        if all(p in parts or any(x.startswith(p + "-") for x in parts) for p in wanted):
            return True
    return False


class Budget:
    """The run's deadline and what later required sections reserve; estimates corrected as arms measure."""

    def __init__(self, seconds: float, start: float | None = None) -> None:
        self.start = time.perf_counter() if start is None else start
        self.seconds = seconds
        self.reserved: dict[str, float] = {}
        self.scale = 1.0
        self._seen: list[tuple[float, float]] = []

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)

    def reserve(self, section: str, seconds: float) -> None:
        self.reserved[section] = seconds

    def release(self, section: str) -> None:
        self.reserved.pop(section, None)

    def fits(self, estimate: float) -> bool:
        return estimate <= self.left() - sum(self.reserved.values())

    def learn(self, expected_s: float, measured_s: float) -> None:
        """Scale later estimates by the median ratio of measured to expected step times so far."""
        if expected_s > 0 and measured_s > 0:
            self._seen.append((expected_s, measured_s))
            ratios = sorted(m / e for e, m in self._seen)
            self.scale = ratios[len(ratios) // 2]

    def arm_cost(self, arm: ArmPlan, steps: int, setup_s: float) -> float:
        """Seconds ``arm`` should take: its setup plus its steps at the corrected step time."""
        return setup_s + steps * arm.est_step_s * self.scale

    def why_not(self, estimate: float) -> str:
        return (f"time budget: needs ~{estimate:.0f} s, {max(self.left(), 0):.0f} s left"
                + (f" ({sum(self.reserved.values()):.0f} s kept for {', '.join(self.reserved)})"
                   if self.reserved else ""))
