"""``scripts/bench-gpu --profile``: what it expects a profile to cost, what it skips, and its analysis of the
profiler's raw events, from fixed numbers and made-up events (no GPU, no ComfyUI, nothing timed)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.gpu import Context, _profile_pass, _Recorder
from bench.gpu_budget import (
    EVENTS_PER_OP,
    OPS_PER_STEP,
    PROFILE_ANALYSIS_S,
    PROFILE_EXPORT_S,
    PROFILE_MAX_EVENTS,
    PROFILE_RECORD_S,
    Budget,
)
from bench.gpu_figures import Device, GpuRun, load_run
from bench.gpu_plan import plan_family
from bench.gpu_profile import MAX_TRACE_BYTES, PastDeadline, _check, self_times


def _sdxl_b4_bound() -> object:
    return next(a for a in plan_family("sdxl", 139.8) if a.id == "sdxl/b4/bound")


def test_a_full_size_sdxl_profile_records_one_step_and_counts_the_profilers_own_cost() -> None:
    budget = Budget(197.0, start=0.0, clock=lambda: 155.0)  # R3: the three arms done at 155 s of 197
    arm = _sdxl_b4_bound()
    cost = budget.profile_cost(arm, 2, 3, MAX_TRACE_BYTES)  # type: ignore[arg-type]
    per_step = OPS_PER_STEP["sdxl"] * EVENTS_PER_OP
    # 62,214 ops a step × 5.5 events: one step is within the event cap, two are not
    assert per_step <= PROFILE_MAX_EVENTS < 2 * per_step
    assert cost.active == 1 and cost.events == per_step and cost.trace
    profiler = per_step * 2 * PROFILE_RECORD_S + per_step * (PROFILE_ANALYSIS_S + PROFILE_EXPORT_S)
    # the arm's set-up and its 2 + 1 + 1 steps, plus the profiler: recording two steps (the schedule's warm-up
    # records too), analysing and exporting the one kept (sums of the same terms: equal up to rounding)
    assert cost.seconds == pytest.approx(budget.arm_cost(arm, 4) + profiler, rel=1e-12)  # type: ignore[arg-type]
    assert profiler > 0.2 * cost.seconds  # what the old estimate (the arm × 1.5, 3 steps) left out
    small = budget.profile_cost(plan_family("sd15", 139.8)[0], 2, 3, MAX_TRACE_BYTES)
    assert small.active == 3  # SD1.5's ~118k events a step: three steps fit the cap
    no_trace = budget.profile_cost(arm, 2, 3, per_step * 10.0)  # type: ignore[arg-type]
    assert not no_trace.trace and no_trace.seconds < cost.seconds and "no trace" in no_trace.describe()


def test_a_profile_that_does_not_fit_is_skipped_with_a_note_and_the_figures_stay(tmp_path: Path) -> None:
    lines: list[str] = []
    ctx = Context(trainers=None, encode_node=type, input_dir=tmp_path, work=tmp_path, out=tmp_path / "out",
                  say=lines.append)
    run = GpuRun(Device("cuda", "NVIDIA H200", 139.8), "scripts/bench-gpu --profile", 20, 3, 197.0)
    rec = _Recorder(run, ctx, {}, 0.0, [])
    budget = Budget(197.0, start=0.0, clock=lambda: 190.0)  # 7 s left
    arms = [a for a in plan_family("sdxl", 139.8) if a.batch == 4]
    _profile_pass(ctx, _Options(), rec, budget, model=None, data=None, arms=arms)  # type: ignore[arg-type]
    assert run.profile == []  # nothing started: no model was touched (it is None here)
    assert [n.split(",")[0] for n in run.notes] == ["profile sdxl/b4/bound: skipped", "profile sdxl/b4/ours: skipped",
                                                  "profile sdxl/b4/builtin: skipped"]
    assert "7 s left" in run.notes[0] and "1 recorded step, ~342k profiler events" in run.notes[0]
    assert load_run(tmp_path / "out" / "results.json").notes == run.notes  # saved with the run's figures


@dataclass
class _Options:
    profile_steps: int = 3
    settings: dict[str, object] | None = None


def test_a_profile_past_its_deadline_stops() -> None:
    _check(None, "never")
    _check(time.perf_counter() + 3600.0, "an hour early")
    with pytest.raises(PastDeadline, match="after 3 of 5 steps"):
        _check(time.perf_counter() - 1.0, "after 3 of 5 steps")


@dataclass
class _Event:
    """What :func:`self_times` reads of a kineto event."""

    label: str
    start: int
    dur: int
    thread: int = 1

    def name(self) -> str:
        return self.label

    def start_ns(self) -> int:
        return self.start

    def duration_ns(self) -> int:
        return self.dur

    def start_thread_id(self) -> int:
        return self.thread


def test_self_time_is_an_events_time_less_the_events_nested_in_it_on_its_thread() -> None:
    events = [_Event("a", 0, 100_000), _Event("b", 10_000, 30_000), _Event("c", 20_000, 10_000),
              _Event("d", 50_000, 10_000), _Event("e", 0, 5_000, thread=2), _Event("d", 70_000, 1_000)]
    # a: 100 µs less b (30) and the two d (10, 1); b: 30 less c (10); every value a whole number of µs: exact
    assert self_times(events) == {"a": 59.0, "b": 20.0, "c": 10.0, "d": 11.0, "e": 5.0}
