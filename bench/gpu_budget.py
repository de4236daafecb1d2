"""How long each part of ``scripts/bench-gpu`` should take, and the time budget that decides what still fits.

The estimates are the H200 run of 2026-11-26 (``docs/bench-gpu-results.json``, run 1: SD1.5 b1/b8, SDXL b1, the
SDXL cap arms, the four encode rows) and, where that run skipped a family, the first GPU run of an earlier version on
the same H200 (``../shared/docs/gpu-notes.md``: SDXL b4, Flux b1/b2, WAN b1; its built-in time at batch ≥ 2); Lumina 2
and Qwen-Image have never run (guesses from their size). They are H200 seconds: :func:`device_factor` scales them by
~1.1 on an H100 (its memory is slower), and :meth:`Budget.learn` replaces that factor by the ratio measured on this
machine as soon as an arm has run. Plain data and arithmetic (no torch): the unit tests check the decisions.

Per arm: ``setup + steps × step``. Set-up = the arm's wall time less its steps at the median (the model copied and
loaded onto the device, the LoRA made, the first step's extra, the bound's batches read first, the unload after):
measured for SD1.5 and SDXL, and for the others the line through those two in the model's size (the time is mostly
moving its weights). The run's first arm pays the device's own first use on top (CUDA context, cuDNN, kernels).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .gpu_plan import ArmPlan, GroupPlan

__all__ = ["EST_STEP_S", "Budget", "RunState", "Forecast", "forecast", "device_factor", "est_step_s",
           "arm_setup_s", "cap_step_s", "build_s", "encode_s", "encode_reserve", "describe_forecast",
           "ProfileCost", "profile_events"]

EST_STEP_S: dict[tuple[str, int], float] = {
    ("sd15", 1): 0.40, ("sd15", 8): 0.38, ("sdxl", 1): 1.25, ("sdxl", 4): 1.13, ("flux", 1): 1.10, ("flux", 2): 1.78,
    ("wan21", 1): 0.87, ("lumina2", 1): 0.55, ("lumina2", 2): 0.90, ("qwen_image", 1): 2.3}
"""H200 seconds per step of the bound (median after warm-up): SD1.5 b1 0.408 / 0.392 / 0.380 (bound / ours /
built-in), b8 0.378; SDXL b1 1.286 / 1.207 / 1.259; SDXL b4 (depth 2) 1.134, Flux b1 1.105, b2 1.773, WAN 0.871 (the
earlier version's run); Lumina 2 and Qwen-Image guessed from their size against Flux."""
BUILTIN_FACTOR: dict[tuple[str, int], float] = {("sd15", 8): 2.3, ("sdxl", 4): 1.3, ("flux", 2): 1.8}
"""The built-in's step at batch ≥ 2 against the bound (it runs B conditionings × B rows): 0.875 / 0.378, 1.462 /
1.134, 3.236 / 1.773; 1.8 where unmeasured. At batch 1 the three arms are within noise of each other."""
SETUP_S: dict[tuple[str, str], float] = {
    ("sd15", "bound"): 5.0, ("sd15", "ours"): 4.0, ("sd15", "builtin"): 3.0,
    ("sdxl", "bound"): 11.0, ("sdxl", "ours"): 11.5, ("sdxl", "builtin"): 5.5}
"""H200 seconds per arm beyond its steps (wall − steps × median, + ~0.7 s between arms): SD1.5 bound 4.6 (b8; b1 12.2
as the run's first arm), ours 2.6–3.8, built-in 2.0–2.9; SDXL 10.0 / 10.7 / 4.7 (its cap arms 9.3–9.8)."""
SETUP_PER_B = {"ours": (1.4, 2.2), "bound": (1.4, 2.2), "builtin": (1.6, 0.45)}
"""(seconds, seconds per billion parameters), for the families :data:`SETUP_S` lacks: the line through SD1.5
(0.86B: ours and the bound 3.3 s, the built-in 2.0, R8) and Flux-dev (11.9B: 25.7–29.5 s and 6.8, R2 and R4); WAN
(1.3B: 5.5–8.8 / 3.0) and Lumina 2 (2.6B: 3.3–5.1 / 1.9–2.6) fall near it. The line through SD1.5 and SDXL it
replaces put Flux at 46 s and Qwen-Image (20B) at 79 s an arm, so a run never found Qwen-Image's ~420 s."""
FIRST_ARM_S = 7.5
"""What the run's first arm pays on top: SD1.5 b1's bound set-up 12.2 s against 4.6 at b8."""
ENCODE_S: dict[str, float] = {"sd15": 2.5, "sdxl": 7.0, "flux": 14.0, "wan21": 14.5}
"""H200 seconds of one encode row of 24 images (folder written, VAE built, ours + built-in, the built-in's release):
2.1 / 7.1 / 11.2 / 12.4 measured without the release, + ~2 s to unload T5-XXL's 5 GB (flux, wan21)."""
ENCODE_WARMUP_S: dict[str, float] = {"sd15": 1.5, "sdxl": 3.0, "flux": 10.0, "wan21": 9.0}
"""H200 seconds of a row's untimed warm-up (both sides on 4 images, then everything unloaded): mostly what does
not grow with the images, i.e. loading the encoders and releasing them (R7, H100: ~4 s for T5-XXL's release on our
side, ~2.5 s on the built-in's)."""
T5_BUILD_S = 10.0
"""Building CLIP-L + T5-XXL fp8 (measured: 22.5 s for the flux row = 11.2 + this + its VAE)."""
CLIP_BUILD_S = 1.0
OPS_PER_STEP: dict[str, int] = {"sd15": 21_541, "sdxl": 62_214, "flux": 38_293, "wan21": 34_066}
"""Dispatcher ops per training step of the bound at batch 1 (docs/BENCHMARKS.md, "Ops per training step", S1:
counted on the CPU at full depth; the batch barely changes it). Other families: :data:`UNKNOWN_OPS`."""
UNKNOWN_OPS = 62_214
EVENTS_PER_OP = 5.5
"""Profiler events per op: 4.0–4.7 on the CPU (an op's nested ops and autograd's records), plus on CUDA a launch
and a kernel record for each kernel-launching op (36–45% of them)."""
PROFILE_RECORD_S = 6e-6
"""Seconds a step slows per event recorded (docs/BENCHMARKS.md, "GPU runs accumulate": 0.8–6.4 µs on the CPU)."""
PROFILE_ANALYSIS_S = 10e-6
"""Seconds per event of :func:`bench.gpu_profile.breakdown` from the raw events (5.8 µs on the CPU)."""
PROFILE_EXPORT_S = 6e-6
"""Seconds per event to export the Chrome trace and gzip it (2.3–5.8 µs on the CPU)."""
TRACE_BYTES_PER_EVENT = 20.0
"""Bytes per event of the gzipped trace (18.5–20.0 on the CPU)."""
PROFILE_MAX_EVENTS = 400_000
"""The most events one profile records: its recorded steps are as many as fit, at least one."""
SPEEDS = (("H200", 1.0), ("H100", 1.1))
UNKNOWN_SPEED = 1.1


def device_factor(name: str) -> float:
    """Seconds on ``name`` per H200 second: 1.0 on an H200, 1.1 on an H100 (HBM3 against HBM3e), 1.1 on another
    device until its first arm measures it."""
    for key, factor in SPEEDS:
        if key in name:
            return factor
    return UNKNOWN_SPEED


def est_step_s(family: str, batch: int, arm: str) -> float:
    """H200 seconds per step of ``arm`` (1.0 where nothing is known)."""
    base = EST_STEP_S.get((family, batch), 1.0)
    if arm == "builtin" and batch > 1:
        return base * BUILTIN_FACTOR.get((family, batch), 1.8)
    return base


def arm_setup_s(family: str, arm: str, params_b: float) -> float:
    """H200 seconds an arm of ``family`` spends beyond its steps (:data:`SETUP_S`, else :data:`SETUP_PER_B`)."""
    known = SETUP_S.get((family, arm))
    if known is not None:
        return known
    a, b = SETUP_PER_B.get(arm, SETUP_PER_B["ours"])
    return a + b * params_b


def cap_step_s(family: str, batch: int, cap_gib: float | None, params_b: float) -> float:
    """H200 seconds per step of ours under ``cap_gib`` with the memory plan ``auto``: the uncapped step where the
    weights fit the cap with room (SDXL in 8 GB: 1.090 s against 1.155 uncapped), twice it where they must stream
    through it (a guess: nothing capped below its weights has run)."""
    base = EST_STEP_S.get((family.removesuffix("_fp8"), batch), 1.0)
    weights_gib = params_b * 2 * 0.93  # bf16 (params_b is already halved for fp8 weights), GB → GiB
    return base * (2.0 if cap_gib is not None and cap_gib < 1.2 * weights_gib else 1.0)


def build_s(params_b: float) -> float:
    """Building a family's model (random weights on the device, loaded by ComfyUI) and its cache: SD1.5 2.1 s,
    SDXL 1.0–3.6 s measured."""
    return 2.0 + 1.2 * params_b


def encode_s(vae: str, images: int) -> float:
    """H200 seconds of one encode row of ``images`` images, its warm-up included (:data:`ENCODE_S`,
    :data:`ENCODE_WARMUP_S`)."""
    return ENCODE_S.get(vae, 12.0) * max(images, 4) / 24 + ENCODE_WARMUP_S.get(vae, 5.0)


def profile_events(family: str) -> float:
    """Profiler events of one recorded step of ``family`` (:data:`OPS_PER_STEP` × :data:`EVENTS_PER_OP`)."""
    return OPS_PER_STEP.get(family, UNKNOWN_OPS) * EVENTS_PER_OP


@dataclass(frozen=True)
class ProfileCost:
    """What a profile of one arm should take: the steps it records, their events, whether its trace is exported
    (only where the gzipped trace would be small enough to keep), and seconds in all."""

    active: int
    events: float
    trace: bool
    seconds: float

    def describe(self) -> str:
        return (f"{self.active} recorded step{'s' if self.active > 1 else ''}, ~{self.events / 1e3:.0f}k profiler "
                f"events{'' if self.trace else ', no trace'}")


@dataclass
class RunState:
    """What the run holds at a point: the model of the pass under way (``None`` between passes) and the text
    encoders built; and whether an arm ran yet (the first pays :data:`FIRST_ARM_S`)."""

    built: str | None = None
    texts: set[str] = field(default_factory=set)
    warm: bool = False
    section: str = ""

    def enter(self, group: GroupPlan) -> None:
        """Before ``group``: a group of another section or family starts a new pass (the last model was freed)."""
        if (group.section, group.family) != (self.section, self.built) and group.section != "encode":
            self.built = None
        self.section = group.section

    def ran(self, group: GroupPlan) -> None:
        """After ``group`` ran."""
        if group.section == "encode":
            self.texts.add(group.text)
        else:
            self.built = group.family
            self.warm = True


class Budget:
    """The run's deadline and what later sections reserve; estimates corrected as arms measure."""

    def __init__(self, seconds: float, start: float | None = None, speed: float = 1.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.start = clock() if start is None else start
        self.seconds = seconds
        self.reserved: dict[str, float] = {}
        self.speed = speed
        """Seconds here per H200 second (:func:`device_factor`), for what nothing measured yet corrects."""
        self.scale = speed
        """Steps: the median ratio of measured to expected (H200) step times so far, ``speed`` before any."""
        self.setup_scale = speed
        self._steps: list[float] = []
        self._setups: list[float] = []

    def left(self) -> float:
        return self.seconds - (self.clock() - self.start)

    def reserve(self, section: str, seconds: float) -> None:
        self.reserved[section] = seconds

    def release(self, section: str) -> None:
        self.reserved.pop(section, None)

    def fits(self, estimate: float, reserved: bool = True) -> bool:
        """Whether ``estimate`` seconds fit before the deadline, less what later sections reserve (``reserved``)."""
        return estimate <= self.left() - (sum(self.reserved.values()) if reserved else 0.0)

    def learn(self, arm: ArmPlan, steps: int, median_s: float | None, wall_s: float, first: bool = False) -> None:
        """Scale later estimates by the median ratios of measured to expected step and set-up times so far
        (``first``: the arm paid :data:`FIRST_ARM_S`, which is not its own set-up)."""
        if median_s and arm.est_step_s > 0:
            self._steps.append(median_s / arm.est_step_s)
            self.scale = statistics.median(self._steps)
            setup = wall_s - steps * median_s - (FIRST_ARM_S * self.speed if first else 0.0)
            if arm.setup_s > 0 and setup > 0:
                self._setups.append(setup / arm.setup_s)
                self.setup_scale = statistics.median(self._setups)

    def arm_cost(self, arm: ArmPlan, steps: int, first: bool = False) -> float:
        """Seconds ``arm`` should take: its set-up plus its steps, corrected (``first``: the run's first arm)."""
        return (arm.setup_s * self.setup_scale + (FIRST_ARM_S * self.speed if first else 0.0)
                + steps * arm.est_step_s * self.scale)

    def group_cost(self, group: GroupPlan, steps: int, state: RunState, images: int = 24) -> float:
        """Seconds ``group`` should take from ``state``: the model built if the pass has none, then its arms; an
        encode row with the text encoders it needs built."""
        if group.section == "encode":
            text = 0.0 if group.text in state.texts else (T5_BUILD_S if "t5" in group.text else CLIP_BUILD_S)
            return (encode_s(group.family, images) + text) * self.speed
        build = build_s(group.params_b) * self.speed if state.built != group.family else 0.0
        arms = sum(self.arm_cost(a, steps) for a in group.arms)
        return build + arms + (FIRST_ARM_S * self.speed if not state.warm else 0.0)

    def profile_cost(self, arm: ArmPlan, skip: int, wanted: int, trace_bytes: float) -> ProfileCost:
        """A profile of ``arm``: ``skip`` steps, then as many of ``wanted`` recorded steps as
        :data:`PROFILE_MAX_EVENTS` allows (at least one), then one more; the set-up and steps as
        :meth:`arm_cost`, the profiler's recording (the schedule's warm-up step records too), the analysis, and the
        trace where it stays under ``trace_bytes``."""
        per_step = profile_events(arm.family)
        active = max(1, min(wanted, int(PROFILE_MAX_EVENTS // per_step)))
        events = per_step * active
        trace = events * TRACE_BYTES_PER_EVENT <= trace_bytes
        profiler = (per_step * (active + 1) * PROFILE_RECORD_S
                    + events * (PROFILE_ANALYSIS_S + (PROFILE_EXPORT_S if trace else 0.0)))
        return ProfileCost(active, events, trace, self.arm_cost(arm, skip + active + 1) + profiler)

    def why_not(self, estimate: float) -> str:
        return (f"time budget: needs ~{estimate:.0f} s, {max(self.left(), 0):.0f} s left"
                + (f" ({sum(self.reserved.values()):.0f} s kept for {', '.join(self.reserved)})"
                   if self.reserved else ""))


@dataclass(frozen=True)
class Forecast:
    """What the budget expects of one group at the start: whether it runs, its seconds, why not."""

    group: GroupPlan
    runs: bool
    seconds: float
    why: str = ""


def encode_reserve(groups: list[GroupPlan], budget: Budget, steps: int, images: int) -> float:
    """Seconds the encode rows of ``groups`` should take (kept free while the training sections before them run)."""
    state = RunState()
    total = 0.0
    for g in (g for g in groups if g.section == "encode"):
        total += budget.group_cost(g, steps, state, images)
        state.ran(g)
    return total


def forecast(groups: list[GroupPlan], budget: Budget, steps: int, images: int = 24) -> list[Forecast]:
    """Run through ``groups`` with the budget's estimates on a simulated clock, deciding as the run will: a group
    that does not fit is skipped and the next ones are still tried (a later, smaller group uses the tail)."""
    spent = [0.0]
    sim = Budget(budget.left(), 0.0, budget.speed, clock=lambda: spent[0])
    sim.scale, sim.setup_scale = budget.scale, budget.setup_scale
    reserve = encode_reserve(groups, sim, steps, images)
    if reserve:
        sim.reserve("encode", reserve)
    state = RunState()
    out = []
    for g in groups:
        if g.section != "main":
            sim.release("encode")
        state.enter(g)
        cost = sim.group_cost(g, steps, state, images)
        if sim.fits(cost):
            spent[0] += cost
            state.ran(g)
            out.append(Forecast(g, True, cost))
        else:
            out.append(Forecast(g, False, cost, sim.why_not(cost)))
    return out


def describe_forecast(plan: list[Forecast], budget_s: float) -> list[str]:
    """The plan as printed at the start of a run: one line per group, then the totals."""
    lines = [f"plan ({budget_s:.0f} s budget):"]
    for f in plan:
        arms = f" ({len(f.group.arms)} arms)" if f.group.arms else ""
        lines.append(f"  {'run ' if f.runs else 'skip'}  {f.group.key:<22} ~{f.seconds:5.0f} s{arms}"
                     + (f"  [{f.why}]" if not f.runs else ""))
    runs = [f for f in plan if f.runs]
    lines.append(f"  expected: {len(runs)} of {len(plan)} groups in ~{sum(f.seconds for f in runs):.0f} s"
                 + (f"; {len(plan) - len(runs)} expected to be skipped" if len(runs) < len(plan) else ""))
    return lines
