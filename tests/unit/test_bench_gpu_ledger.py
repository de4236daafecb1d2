"""``scripts/bench-gpu``'s groups, the accumulation of runs (``--missing``, the ledger) and the budget's plan, from
fixed figures and a simulated clock (no GPU, no ComfyUI, nothing timed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gpu_budget import Budget, device_factor, forecast
from bench.gpu_figures import Device, EncodeFigures, GpuRun, TrainFigures
from bench.gpu_ledger import Ledger, group_state, load_ledger, merge, missing, owners, save_ledger
from bench.gpu_models import FULL_FAMILIES, FULL_VAES
from bench.gpu_plan import ArmPlan, GroupPlan, group_key, plan_family, plan_groups, rounds, select

PARAMS = {k: f.params_b for k, f in FULL_FAMILIES.items()}
TEXTS = {k: v.text for k, v in FULL_VAES.items()}
H200 = Device("cuda", "NVIDIA H200", 139.8)
H100 = Device("cuda", "NVIDIA H100 80GB HBM3", 79.2)


@pytest.mark.parametrize(("fig_id", "key"), [
    ("sd15/b1/ours", "sd15/b1"), ("qwen_image/b1/builtin", "qwen_image/b1"), ("cap/flux_fp8-12/ours", "cap/flux_fp8"),
    ("cap/sdxl-none/ours", "cap/sdxl"), ("ckpt/sdxl-fast/ours", "ckpt/sdxl"), ("devices/wan21-4/ours", "devices/wan21"),
    ("encode/flux", "encode/flux"),
    ("profile/sdxl/b1/ours", "profile/sdxl/b1/ours")])
def test_each_figure_belongs_to_the_group_compared_side_by_side(fig_id: str, key: str) -> None:
    assert group_key(fig_id) == key


def test_repeated_rows_alternate_the_order_and_run_every_arm_n_times() -> None:
    row = plan_family("sd15", 139.8, (1,))
    assert [a.arm for a in row] == ["bound", "ours", "builtin"]
    order = rounds(row, 3)
    assert [(a.arm, a.rep) for a in order] == [
        ("bound", 0), ("ours", 0), ("builtin", 0), ("ours", 1), ("builtin", 1), ("bound", 1),
        ("builtin", 2), ("bound", 2), ("ours", 2)]
    arms = plan_family("sd15", 139.8, repeat=2)  # every row repeats, batch ≥ 2 as batch 1, each in rotating order
    assert [(a.id, a.rep) for a in arms if a.batch == 8] == [
        ("sd15/b8/bound", 0), ("sd15/b8/ours", 0), ("sd15/b8/builtin", 0),
        ("sd15/b8/ours", 1), ("sd15/b8/builtin", 1), ("sd15/b8/bound", 1)]
    assert len([a for a in arms if a.batch == 1]) == 6


def test_repeat_covers_every_training_group_but_not_the_encode_rows() -> None:
    once = {g.key: g for g in plan_groups(PARAMS, TEXTS, 139.8, 2)}
    twice = {g.key: g for g in plan_groups(PARAMS, TEXTS, 139.8, 2, repeat=2)}
    assert list(once) == list(twice)
    for key, g in twice.items():
        reps = 1 if g.section == "encode" else 2
        assert len(g.arms) == reps * len(once[key].arms), key
        assert sorted((a.id, a.rep) for a in g.arms) == sorted((a.id, r) for a in once[key].arms
                                                               for r in range(reps)), key
    assert [(a.id, a.rep) for a in twice["cap/sdxl"].arms] == [
        ("cap/sdxl-none/ours", 0), ("cap/sdxl-8/ours", 0), ("cap/sdxl-8/ours", 1), ("cap/sdxl-none/ours", 1)]
    # --only picks the rows; the repetitions come with them, and the budget's plan counts every one
    (b4,) = select(list(twice.values()), ["sdxl/b4"])
    assert len(b4.arms) == 6
    budget = Budget(1e6, clock=lambda: 0.0)
    (one,) = forecast(select(list(once.values()), ["sdxl/b4"]), budget, 24)
    (two,) = forecast([b4], budget, 24)
    assert two.seconds - one.seconds == pytest.approx(sum(budget.arm_cost(a, 24) for a in b4.arms[:3]), rel=1e-9)


def test_the_plan_is_every_group_in_run_order() -> None:
    keys = [g.key for g in plan_groups(PARAMS, TEXTS, 139.8, 1)]
    assert keys == ["sd15/b1", "sd15/b8", "sdxl/b1", "sdxl/b4", "flux/b1", "flux/b2", "wan21/b1",
                    "encode/sd15", "encode/sdxl", "encode/flux", "encode/wan21",
                    "cap/sdxl", "cap/flux", "cap/flux_fp8", "cap/wan21",
                    "ckpt/sd15", "ckpt/sdxl", "ckpt/flux", "ckpt/wan21", "ckpt/sdxl_b4",
                    "options/sd15", "options/sdxl", "options/flux",
                    "devices/sd15", "devices/sdxl", "devices/flux", "devices/wan21",
                    "lumina2/b1", "lumina2/b2", "qwen_image/b1"]
    groups = plan_groups(PARAMS, TEXTS, 139.8, 1)
    assert {g.section for g in groups if g.key.startswith("cap/")} == {"cap"}
    assert {g.section for g in groups if g.key.startswith("ckpt/")} == {"ckpt"}
    assert [a.id for a in next(g for g in groups if g.key == "ckpt/flux").arms] == [
        "ckpt/flux-exact/ours", "ckpt/flux-fast/ours", "ckpt/flux-kept/ours"]
    assert {g.section for g in groups if g.key.startswith("options/")} == {"options"}
    assert [a.id for a in next(g for g in groups if g.key == "options/flux").arms] == [
        f"options/flux-{mode}/ours"
        for mode in ("plain", "clip", "ema", "snr", "all", "layers", "prodigy", "adafactor", "dropout")]
    assert next(g for g in groups if g.key == "cap/flux_fp8").family == "flux_fp8"
    assert next(g for g in groups if g.key == "encode/flux").text == "clip_l+t5xxl"


def test_only_and_missing_select_groups_and_arms_in_plan_order() -> None:
    groups = plan_groups(PARAMS, TEXTS, 139.8, 1)
    picked = select(groups, ["flux/ours", "encode"], {"flux/b2", "encode/wan21", "sd15/b1"})
    assert [(g.key, [a.id for a in g.arms]) for g in picked] == [("flux/b2", ["flux/b2/ours"]), ("encode/wan21", [])]
    assert [g.key for g in select(groups, [], {"wan21/b1", "sdxl/b4"})] == ["sdxl/b4", "wan21/b1"]


# ------------------------------------------------------------------------------------------------ merging
def _arm(fig_id: str, step: float | None = 0.5, **kw: object) -> TrainFigures:
    family, batch, arm = fig_id.split("/") if not fig_id.startswith("cap/") else (fig_id.split("/")[1], "b1", "ours")
    return TrainFigures(fig_id, family.split("-")[0], int(batch[1:]), arm, 1,
                        step_s=[step] * 3 if step is not None else [], **kw)  # type: ignore[arg-type]


def _row(key: str, step: float = 0.5, **kw: object) -> list[TrainFigures]:
    return [_arm(f"{key}/{arm}", step, **kw) for arm in ("bound", "ours", "builtin")]


def _run(date: str, train: list[TrainFigures], encode: list[EncodeFigures] | None = None,
         device: Device = H200) -> GpuRun:
    return GpuRun(device, f"scripts/bench-gpu --at {date}", 20, 3, 400.0, train, encode or [], date=date,
                  commit="c" + date[-2:])


def test_a_groups_state_says_whether_it_can_stand_for_its_row() -> None:
    assert group_state("sd15/b1", _row("sd15/b1")) == "measured"
    oom = [*_row("sd15/b8")[:2], _arm("sd15/b8/builtin", None, error="out of memory (tried 80 GiB)")]
    assert group_state("sd15/b8", oom) == "measured"  # out of memory is the built-in's result there
    broken = [*_row("sd15/b8")[:2], _arm("sd15/b8/builtin", None, error="RuntimeError: boom")]
    assert group_state("sd15/b8", broken) == "failed"
    assert group_state("sd15/b8", _row("sd15/b8")[:2]) == "partial"  # --only sd15/bound,sd15/ours
    cut = [*_row("sd15/b8")[:2], _arm("sd15/b8/builtin", None, skipped="time budget")]
    assert group_state("sd15/b8", cut) == "partial"
    assert group_state("sd15/b8", [_arm(f"sd15/b8/{a}", None, skipped="time") for a in ("bound", "ours")]) == "skipped"
    assert group_state("cap/sdxl", [_arm("cap/sdxl-none/ours")]) == "partial"  # its 8 GB arm is missing
    assert group_state("cap/sdxl", [_arm("cap/sdxl-none/ours"), _arm("cap/sdxl-8/ours")]) == "measured"
    assert group_state("encode/sd15", [EncodeFigures("encode/sd15", "SD", 2, (8, 8), ours_s=1.0)]) == "measured"


def test_a_later_run_keeps_what_it_did_not_measure_again_and_replaces_what_it_did() -> None:
    first = _run("2026-11-26", [*_row("sd15/b1", 0.4), *_row("sdxl/b1", 1.2),
                                *[_arm(f"flux/b1/{a}", None, skipped="time budget") for a in ("bound", "ours")]],
                 [EncodeFigures("encode/sd15", "SD", 24, (512, 512), ours_s=1.0, builtin_s=1.0)])
    ledger = merge(Ledger(), first)
    assert [r.number for r in ledger.runs] == [1] and first.number == 0  # the argument is left as it was
    second = _run("2026-11-27", [*_row("sdxl/b1", 1.1),  # re-measured: replaces R1's
                                 *_row("flux/b1", 1.0),  # measured for the first time: replaces R1's skips
                                 *_row("sd15/b1", 0.3)[:1],  # partial: R1's whole row stays
                                 *[_arm(f"wan21/b1/{a}", None, skipped="time budget") for a in ("bound", "ours")]],
                  device=H100)
    ledger = merge(ledger, second)
    shown = owners(ledger.runs)
    assert {k: r.number for k, (r, _) in shown.items()} == {
        "sd15/b1": 1, "encode/sd15": 1, "sdxl/b1": 2, "flux/b1": 2, "wan21/b1": 2}
    assert [f.median_s for f in shown["sdxl/b1"][1]] == [1.1, 1.1, 1.1]
    r1, r2 = ledger.runs
    assert [f.id for f in r1.train] == ["sd15/b1/bound", "sd15/b1/ours", "sd15/b1/builtin"]  # only what it shows
    assert r2.number == 2 and r2.device.name == H100.name and r2.commit == "c27"
    assert "sd15/b1/bound" not in [f.id for f in r2.train]  # its partial row was not taken

    third = _run("2026-11-28", _row("sd15/b1", 0.35),
                 [EncodeFigures("encode/sd15", "SD", 24, (512, 512), ours_s=2.0, builtin_s=1.0)])
    ledger = merge(ledger, third)
    assert [r.number for r in ledger.runs] == [2, 3]  # R1 shows nothing any more: dropped
    assert merge(ledger, third).runs == ledger.runs  # the same run merged again replaces itself


def test_a_failure_replaces_old_figures_and_a_skip_replaces_only_a_skip() -> None:
    ledger = merge(Ledger(), _run("2026-11-26", _row("sd15/b1")))
    failed = [*_row("sd15/b1")[:2], _arm("sd15/b1/builtin", None, error="RuntimeError: boom")]
    after = merge(ledger, _run("2026-11-27", failed))
    assert group_state("sd15/b1", owners(after.runs)["sd15/b1"][1]) == "failed"
    skipped = [_arm(f"sd15/b1/{a}", None, skipped="time budget") for a in ("bound", "ours", "builtin")]
    kept = merge(ledger, _run("2026-11-27", skipped))
    assert owners(kept.runs)["sd15/b1"][0].number == 1
    newer = merge(merge(Ledger(), _run("2026-11-26", skipped)), _run("2026-11-27", skipped))
    assert [r.number for r in newer.runs] == [2]


def test_missing_names_in_plan_order_what_is_not_measured() -> None:
    keys = [g.key for g in plan_groups(PARAMS, TEXTS, 139.8, 1)]
    assert missing(Ledger(), keys) == keys
    failed = [*_row("sd15/b8")[:2], _arm("sd15/b8/builtin", None, error="KeyError: x")]
    run = _run("2026-11-26", [*_row("sd15/b1"), *failed, *_row("sdxl/b4")[:2],
                              *[_arm(f"flux/b1/{a}", None, skipped="time") for a in ("bound", "ours", "builtin")]],
               [EncodeFigures(f"encode/{v}", v, 24, (512, 512), ours_s=1.0, builtin_s=1.0) for v in TEXTS])
    left = missing(merge(Ledger(), run), keys)
    assert left[:5] == ["sd15/b8", "sdxl/b1", "sdxl/b4", "flux/b1", "flux/b2"]
    assert "sd15/b1" not in left and not any(k.startswith("encode/") for k in left)


def test_the_ledger_survives_its_file_and_refuses_another_format(tmp_path: Path) -> None:
    ledger = merge(Ledger(), _run("2026-11-26", _row("sd15/b1"), [EncodeFigures("encode/sd15", "SD", 2, (8, 8))]))
    path = tmp_path / "docs" / "bench-gpu-results.json"
    save_ledger(ledger, path)
    assert load_ledger(path) == ledger
    assert load_ledger(tmp_path / "absent.json") == Ledger()
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"runs": []}))
    with pytest.raises(ValueError, match="other.json: not a bench-gpu ledger"):
        load_ledger(other)


# ------------------------------------------------------------------------------------------------ the budget
def _group(key: str, step: float, setup: float = 0.0) -> GroupPlan:
    arm = ArmPlan(f"{key}/ours", key.split("/")[0], 1, "ours", 1, est_step_s=step, setup_s=setup)
    return GroupPlan(key, "main", key.split("/")[0], (arm,))


def test_the_plan_skips_what_will_not_fit_and_uses_the_tail_for_what_does() -> None:
    budget = Budget(100.0, start=0.0, clock=lambda: 0.0)
    groups = [_group(k, step) for k, step in (("a/b1", 1.0), ("b/b1", 4.0), ("c/b1", 1.0), ("d/b1", 2.5),
                                              ("e/b1", 0.5))]
    plan = forecast(groups, budget, 20)
    # a: its model (2 s) + the device's first use (7.5 s) + 20 steps of 1 s: 29.5 s, 70.5 left; b: 2 + 80 s does
    # not fit; c: 22 s, 48.5 left; d: 52 s does not fit; e: 12 s does (the tail is used)
    assert [(f.group.key, f.runs) for f in plan] == [("a/b1", True), ("b/b1", False), ("c/b1", True),
                                                      ("d/b1", False), ("e/b1", True)]
    assert [round(f.seconds, 1) for f in plan] == [29.5, 82.0, 22.0, 52.0, 12.0]
    assert "needs ~82 s, 70 s left" in plan[1].why
    assert budget.left() == 100.0  # the forecast runs on its own clock


def test_encode_rows_keep_their_time_from_the_training_before_them() -> None:
    groups = [_group("a/b1", 2.0), GroupPlan("encode/sd15", "encode", "sd15", text="clip_l")]
    budget = Budget(50.0, start=0.0, clock=lambda: 0.0)
    plan = forecast(groups, budget, 20)
    assert [f.runs for f in plan] == [False, True]  # 49.5 s would leave too little for the encode row (3.5 s)
    assert "kept for encode" in plan[0].why


def test_estimates_are_h200_seconds_scaled_for_the_device() -> None:
    assert device_factor(H200.name) == 1.0 and device_factor(H100.name) == 1.1
    assert device_factor("NVIDIA A100-SXM4-80GB") == 1.1  # unknown: like an H100 until measured
    groups = plan_groups(PARAMS, TEXTS, 139.8, 1)
    on_h200 = forecast(groups, Budget(1e6, speed=1.0, clock=lambda: 0.0), 24)
    on_h100 = forecast(groups, Budget(1e6, speed=1.1, clock=lambda: 0.0), 24)
    assert all(f.runs for f in on_h200)
    assert sum(f.seconds for f in on_h100) == pytest.approx(1.1 * sum(f.seconds for f in on_h200), rel=1e-9)
    sd15 = next(f for f in on_h200 if f.group.key == "sd15/b1")
    # the run's first group: SD1.5 built, the device's first use, three arms of 24 steps at the H200 run's medians
    assert 30.0 < sd15.seconds < 60.0
    everything = sum(f.seconds for f in on_h200 if f.group.section in ("main", "encode"))
    assert everything > 2 * 400  # why the required families take several sessions (--missing)


# ------------------------------------------------------------------------------------------------ the docs
DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_docs_gpu_section_is_the_ledger_rendered_with_the_h200_run_as_r1() -> None:
    from bench.gpu_docs import section_of

    ledger = load_ledger(DOCS / "bench-gpu-results.json")
    r1 = ledger.runs[0]
    assert (r1.number, r1.date, r1.device.name, r1.steps, r1.warmup) == (1, "2026-11-26", "NVIDIA H200", 20, 3)
    shown = {k: (run.number, group_state(k, figs)) for k, (run, figs) in owners(ledger.runs).items()}
    for key in ("sd15/b8", "sdxl/b1", "cap/sdxl"):  # R1's groups no later run measured again
        assert shown[key] == (1, "measured"), key
    for key in ("sd15/b1", "encode/sd15", "encode/sdxl", "encode/flux", "encode/wan21"):  # measured again since
        assert shown[key][0] > 1 and shown[key][1] == "measured", key
    doc = (DOCS / "BENCHMARKS.md").read_text()
    section = doc.split("<!-- bench:gpu:begin -->\n", 1)[1].split("\n<!-- bench:gpu:end -->", 1)[0]
    assert section + "\n" == section_of(ledger), "rewrite it: scripts/bench-gpu --render"


def test_merge_adds_a_results_file_once_and_rewrites_the_section(tmp_path: Path) -> None:
    from bench.gpu_docs import merge_results
    from bench.gpu_figures import save_run

    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\nabove\n\n<!-- bench:gpu:begin -->\nold\n<!-- bench:gpu:end -->\n\nbelow\n")
    results = tmp_path / "results.json"
    old = _run("", _row("sd15/b1"))
    old.commit = ""  # a results.json written before runs recorded their date and commit
    save_run(old, results)
    with pytest.raises(ValueError, match="results.json: the run has no date; pass --run-date"):
        merge_results(results, tmp_path / "ledger.json", doc)
    ledger = merge_results(results, tmp_path / "ledger.json", doc, "2026-11-26", "abc")
    assert [(r.number, r.date, r.commit) for r in ledger.runs] == [(1, "2026-11-26", "abc")]
    assert merge_results(results, tmp_path / "ledger.json", doc, "2026-11-26", "abc") == ledger  # once
    text = doc.read_text()
    assert "above" in text and "below" in text and "\nold\n" not in text
    assert "| SD1.5 | 512², b1 | R1 |" in text and "`sd15/b8`" in text.split("Still without figures")[1]
