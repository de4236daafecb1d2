"""``scripts/bench-gpu``'s plan, budget and report, from fixed figures (no GPU, no ComfyUI, nothing timed).

The harness itself (model construction, the arms, timing) runs on tiny models in ``tests/comfy/test_bench_gpu.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.gpu_figures import (
    Device, EncodeFigures, GpuRun, ProfileFigures, TrainFigures, load_run, run_from_dict, save_run,
)
from bench.gpu_budget import Budget
from bench.gpu_plan import (
    STEP_OPTION_ARMS, choose_depth, group_key, matches, plan_caps, plan_ckpt_modes, plan_devices, plan_family,
    plan_step_options,
)
from bench.gpu_report import PLACEHOLDER, render


def test_depth_is_one_where_the_first_runs_depth_one_peak_fits_the_device() -> None:
    assert choose_depth("sd15", 1, 79.2) == (1, "")
    depth, note = choose_depth("sd15", 8, 79.2)  # 79.6 GiB at depth 1 on the H200
    assert depth == 2 and "79.6 GiB" in note
    assert choose_depth("sd15", 8, 139.8) == (1, "")
    assert choose_depth("flux", 1, 139.8)[0] == 2  # never measured at depth 1: taken not to fit
    assert choose_depth("flux", 2, 79.2, forced=1) == (1, "set by --depth")


def test_each_family_batch_has_three_arms_side_by_side_at_one_depth() -> None:
    arms = plan_family("sdxl", 79.2)
    assert [a.id for a in arms] == [f"sdxl/b{b}/{k}" for b in (1, 4) for k in ("bound", "ours", "builtin")]
    for batch in (1, 4):
        assert len({a.depth for a in arms if a.batch == batch}) == 1
    builtin_b4 = next(a for a in arms if a.id == "sdxl/b4/builtin")
    assert builtin_b4.est_step_s > next(a for a in arms if a.id == "sdxl/b4/bound").est_step_s
    assert all(a.extra == {"memory": "auto"} for a in plan_caps())
    assert {a.cap_gib for a in plan_caps()} == {None, 8.0, 12.0, 24.0}
    assert all(a.extra == {"devices": "auto"} and a.id.endswith("-4/ours") for a in plan_devices(4))
    assert [(a.id, a.extra, a.batch) for a in plan_ckpt_modes() if a.family == "sdxl"] == [
        ("ckpt/sdxl-exact/ours", {"checkpoint_mode": "exact", "memory": "no offload"}, 1),
        ("ckpt/sdxl-fast/ours", {"checkpoint_mode": "fast", "memory": "no offload"}, 1),
        ("ckpt/sdxl-kept/ours", {"checkpoint_mode": "exact", "memory": "auto + keep blocks whole"}, 1),
        # batch 4: what keeping blocks whole buys where auto checkpoints every block (no fast: a batch-1 question)
        ("ckpt/sdxl_b4-exact/ours", {"checkpoint_mode": "exact", "memory": "no offload"}, 4),
        ("ckpt/sdxl_b4-kept/ours", {"checkpoint_mode": "exact", "memory": "auto + keep blocks whole"}, 4)]
    assert {a.family for a in plan_ckpt_modes()} == {"sd15", "sdxl", "flux", "wan21"}


def test_the_option_arms_are_ours_without_and_with_each_extra_at_batch_one() -> None:
    arms = [a for a in plan_step_options() if a.family == "sd15"]
    assert [(a.id, a.extra, a.batch, a.arm) for a in arms] == [
        ("options/sd15-plain/ours", {}, 1, "ours"),
        ("options/sd15-clip/ours", {"max_grad_norm": 1.0}, 1, "ours"),
        ("options/sd15-ema/ours", {"ema_decay": 0.999}, 1, "ours"),
        ("options/sd15-snr/ours", {"min_snr_gamma": 5.0}, 1, "ours"),
        ("options/sd15-all/ours", {"max_grad_norm": 1.0, "ema_decay": 0.999, "min_snr_gamma": 5.0}, 1, "ours"),
        ("options/sd15-layers/ours", {"train_layers": "attn"}, 1, "ours"),
        ("options/sd15-prodigy/ours", {"optimizer": "Prodigy", "learning_rate": 1.0}, 1, "ours"),
        ("options/sd15-adafactor/ours", {"optimizer": "Adafactor"}, 1, "ours"),
        ("options/sd15-lion/ours", {"optimizer": "Lion", "learning_rate": 1e-4}, 1, "ours"),
        ("options/sd15-adamw8bit/ours", {"optimizer": "AdamW8bit"}, 1, "ours"),
        ("options/sd15-lion8bit/ours", {"optimizer": "Lion8bit", "learning_rate": 1e-4}, 1, "ours"),
        ("options/sd15-dropout/ours", {"rank_dropout": 0.1, "module_dropout": 0.1}, 1, "ours")]
    flux = {a.id.split("/")[1].removeprefix("flux-") for a in plan_step_options() if a.family == "flux"}
    assert flux == set(STEP_OPTION_ARMS) - {"lion", "adamw8bit", "lion8bit"}  # one device call's worth
    assert next(a.extra for a in plan_step_options() if a.id == "options/flux-layers/ours") == {
        "train_layers": "double_blocks"}
    assert {a.family for a in plan_step_options()} == {"sd15", "sdxl", "flux"}
    assert {group_key(a.id) for a in plan_step_options()} == {"options/sd15", "options/sdxl", "options/flux"}
    # each arm's settings are its own copy: a run that changes one leaves the plan as it was
    arms[4].extra["max_grad_norm"] = 2.0
    assert STEP_OPTION_ARMS["all"]["max_grad_norm"] == 1.0
    assert matches("options/sd15-all/ours", ["options/sd15"]) and not matches("options/sd15-all/ours", ["options/sdxl"])


@pytest.mark.parametrize(("patterns", "selected"), [
    ([], True), (["flux"], True), (["flux/ours"], True), (["b2"], True), (["flux/b1"], False),
    (["sdxl", "flux/builtin"], False), (["cap"], False), (["flux/bound", "b2/ours"], True)])
def test_only_selects_by_parts_of_the_id(patterns: list[str], selected: bool) -> None:
    assert matches("flux/b2/ours", patterns) is selected


def test_only_matches_the_family_of_a_capped_arm() -> None:
    assert matches("cap/flux-12/ours", ["cap/flux"]) and matches("cap/flux-12/ours", ["cap/flux-12"])
    assert not matches("cap/flux-12/ours", ["cap/sdxl"])


def test_budget_keeps_what_later_sections_reserve_and_learns_from_measured_steps() -> None:
    clock = [0.0]  # a fixed clock: nothing here is timed
    budget = Budget(100.0, start=0.0, clock=lambda: clock[0])
    arm = plan_family("sd15", 79.2)[0]
    assert budget.fits(budget.arm_cost(arm, 23))
    budget.reserve("encode", 90.0)
    assert not budget.fits(20.0) and "kept for encode" in budget.why_not(20.0)
    assert budget.fits(20.0, reserved=False)  # a group under way may use what later sections keep
    budget.release("encode")
    for ratio in (2.0, 4.0, 3.0):
        budget.learn(arm, 10, arm.est_step_s * ratio, 10 * arm.est_step_s * ratio + 2 * arm.setup_s)
    # the median ratios of measured to expected: (est × 3) / est, equal to 3 up to one rounding of each operation
    assert budget.scale == pytest.approx(3.0, rel=1e-12) and budget.setup_scale == pytest.approx(2.0, rel=1e-12)
    assert budget.arm_cost(arm, 10) == pytest.approx(arm.setup_s * 2.0 + 10 * arm.est_step_s * 3.0)
    clock[0] = 99.0
    assert budget.left() == 1.0 and not budget.fits(2.0)


def _fig(arm: str, batch: int, step: float, peak: float, **kw: object) -> TrainFigures:
    return TrainFigures(f"sdxl/b{batch}/{arm}", "sdxl", batch, arm, 2, "depth 1 would not fit", step_s=[step] * 20,
                        first_s=9.0, peak_gib=peak, losses=[0.5] * 23, **kw)  # type: ignore[arg-type]


@pytest.fixture
def run() -> GpuRun:
    device = Device("cuda", "NVIDIA H100 80GB HBM3", 79.2, torch="2.11.0+cu130", cuda="13.0", cudnn="91900",
                    comfyui="0.28.0", python="3.12.3", host="16 cores")
    train = [_fig("bound", 1, 0.400, 12.0), _fig("ours", 1, 0.402, 12.1, data_wait_pct=0.3),
             _fig("builtin", 1, 0.410, 12.5),
             _fig("bound", 4, 1.10, 10.6), _fig("ours", 4, 1.13, 10.6, data_wait_pct=0.1),
             TrainFigures("sdxl/b4/builtin", "sdxl", 4, "builtin", 2, error="out of memory (tried 2 GiB)"),
             TrainFigures("flux/b1/bound", "flux", 1, "bound", 2, skipped="time budget: needs ~80 s, 20 s left"),
             TrainFigures("cap/sdxl-8/ours", "sdxl", 1, "ours", 1, step_s=[0.5] * 20, losses=[0.5] * 23,
                          cap_gib=8.0, peak_gib=7.5),
             TrainFigures("cap/sdxl-none/ours", "sdxl", 1, "ours", 1, step_s=[0.4] * 20, losses=[0.5001] * 23,
                          peak_gib=14.0)]
    encode = [EncodeFigures("encode/sd15", "SD1.5 (SD VAE, CLIP-L)", 24, (512, 512), ours_s=4.0, builtin_s=6.0,
                            ours_free_gib=78.0, builtin_free_gib=77.0, free_before_gib=78.5, ours_release_s=1.0,
                            builtin_release_s=0.5, builtin_released_free_gib=78.4),
              EncodeFigures("encode/sd15x", "SD1.5 again", 24, (512, 512), ours_s=4.0, builtin_s=6.0,
                            ours_release_s=1.0, builtin_release_s=0.5, warmup_s=3.0,
                            ours_phases={"plan": 0.25, "run": 2.5, "encoder": 2.0, "lock_wait": 0.001}),
              EncodeFigures("encode/sdxl", "SDXL", 24, (1024, 1024), ours_s=2.0, builtin_s=3.0),  # an older run's
              EncodeFigures("encode/flux", "Flux", 24, (1024, 1024), error="RuntimeError: boom")]
    profile = [ProfileFigures("profile/sdxl/b1/ours", 3, 402.0, 30.0, 372.0, 1.0, 1.0, 395.0, 0.0, 0.0, 3.0,
                              labels_ms={"streamcache.conditioning": 2.5}, top_ops=[("aten::mm", 4.0)],
                              trace="trace_profile_sdxl_b1_ours.json.gz")]
    return GpuRun(device, "scripts/bench-gpu", 20, 3, 450.0, train, encode, profile,
                  notes=["Multi-GPU arms (#26): skipped, 1 CUDA GPU here (they need 2 or more)."],
                  builds={"sdxl": 21.0}, seconds=430.0, finished=True, date="2026-11-27 09:00 UTC", commit="abc1234")


def test_the_section_names_the_device_and_checks_every_goal(run: GpuRun) -> None:
    text = render(run)
    lines = text.splitlines()
    assert lines[0] == "## GPU benchmarks (`scripts/bench-gpu`)"
    head = next(line for line in lines if line.startswith("- **R1** "))
    assert head.startswith("- **R1** 2026-11-27 09:00 UTC, NVIDIA H100 80GB HBM3 79.2 GiB, commit abc1234: "
                           "`scripts/bench-gpu` (7.2 min of a 7.5 min budget, finished; 20 steps after 3 warm-up). "
                           "torch 2.11.0+cu130, CUDA 13.0, cuDNN 91900; ComfyUI 0.28.0; Python 3.12.3; host: 16 cores.")
    assert "Notes: Multi-GPU arms (#26): skipped, 1 CUDA GPU here (they need 2 or more)." in head
    b1 = next(line for line in lines if line.startswith("| SDXL | 1024², b1 | R1 |"))
    assert "| 0.400 | 0.402 | 0.410 | 99.5% | 1.02× |" in b1 and "≥ 99% of bound: met; ≥ 1× built-in: met" in b1
    # every step equal: ours' p10–p90 is one value, and ours vs the bound at p10 is the ratio of the medians
    assert "9.0 / 9.0 / 9.0 | 12.0 / 12.1 / 12.5 | 0.402–0.402; 99.5%; 1.02× | 0.3% |" in b1
    b4 = next(line for line in lines if line.startswith("| SDXL | 1024², b4 | R1 |"))
    assert "| out of memory |" in b4 and "≥ 99% of bound: NOT met" in b4 and "built-in out of memory: met" in b4
    assert "- `flux/b1/bound` (R1): time budget: needs ~80 s, 20 s left" in lines
    assert "- `sdxl/b4/builtin` (R1): out of memory (tried 2 GiB)" in lines
    cap = next(line for line in lines if line.startswith("| `cap/sdxl-8/ours` | R1 |"))
    assert "| 8 | 0.500 | 80.0% | 7.5 |" in cap and "| 1.00e-04 |" in cap
    # 24 images: ours 4.0 s with a 1.0 s release, the built-in 6.0 s and 0.5 s to release after it
    assert ("| SD1.5 (SD VAE, CLIP-L) | R1 | 24 × 512×512 | 8.00 / 6.00 | 4.00 / 3.69 | 2.00× / 1.62× | 1.00 / 0.50 "
            "| 78.5 | 78.0 | 77.0 / 78.4 |") in lines
    assert "| SDXL | R1 | 24 × 1024×1024 | — / 12.00 | 8.00 / — | — / — | — / — | — | — | — / — |" in lines
    assert "- `encode/sdxl` (R1): the releases were not timed in that run; ours with its release ÷ the built-in " \
           "without: 1.50×" in lines
    assert "- `encode/flux` (R1): RuntimeError: boom" in lines
    # a row timed without the warm-up says so; one with it, and one too old to have timed its releases, do not
    notes = [line for line in lines if "no warm-up in that run" in line]
    assert notes == ["- `encode/sd15` (R1): no warm-up in that run: ours ran first on kernels the process had not "
                     "used yet"]
    # where ours' seconds went, when recorded (a phase under 5 ms left out)
    assert [line for line in lines if line.startswith("- `") and "ours' seconds" in line] == [
        "- `encode/sd15x` (R1): ours' seconds: plan 0.25, run 2.50, encoder 2.00"]
    assert any(line.startswith("| `profile/sdxl/b1/ours` | R1 | 3 | 402.0 | 30.0 | 372.0 (1.0) |") for line in lines)


def test_repeated_arms_give_the_median_of_their_medians_and_its_range(run: GpuRun) -> None:
    order = [("bound", 0, 0.40, 2.0), ("ours", 0, 0.41, 2.1), ("builtin", 0, 0.42, 6.0),  # --repeat 2's order
             ("ours", 1, 0.39, 2.2), ("builtin", 1, 0.46, 6.1), ("bound", 1, 0.42, 2.0)]
    run.train = [TrainFigures(f"sd15/b1/{arm}", "sd15", 1, arm, 1, step_s=[step] * 5, first_s=2.0 + rep,
                              peak_gib=peak, rep=rep) for arm, rep, step, peak in order]
    run.repeat = 2
    text = render(run)
    line = next(x for x in text.splitlines() if x.startswith("| SD1.5 | 512², b1 |"))
    # medians: bound 0.40, 0.42; ours 0.41, 0.39; built-in 0.42, 0.46 → 0.410, 0.400, 0.440 (and their ranges)
    assert ("| R1 ×2 | 1 | 0.410 (0.400–0.420) | 0.400 (0.390–0.410) | 0.440 (0.420–0.460) | 102.5% | 1.10× |"
            in line)
    assert "| 2.5 / 2.5 / 2.5 | 2.0 / 2.2 / 6.1 |" in line  # first step: the median; peak: the largest
    assert "rows ×2" in text


def test_the_spread_of_each_arms_steps_is_shown_beside_its_median(run: GpuRun) -> None:
    ours = [1.0 + 0.1 * i for i in range(11)]  # 1.0 … 2.0: p10 1.1, p90 1.9 (inclusive deciles of 11 values)
    bound = [1.0 + 0.05 * i for i in range(11)]  # p10 1.05: ours vs bound at p10 = 1.05 / 1.1
    run.train = [TrainFigures("sdxl/b4/bound", "sdxl", 4, "bound", 2, step_s=bound, first_s=9.0, peak_gib=10.0),
                 TrainFigures("sdxl/b4/ours", "sdxl", 4, "ours", 2, step_s=ours, first_s=9.0, peak_gib=10.0)]
    line = next(x for x in render(run).splitlines() if x.startswith("| SDXL | 1024², b4 |"))
    assert "| 1.100–1.900; 95.5% |" in line
    # repetitions: the steps of every repetition together (22 values 1.0 … 2.0, 3.0 … 4.0: the inclusive p10 lies
    # at 2.1 of 21 intervals, 1.2 + 0.1 × 0.1 = 1.21; p90 at 18.9, 3.7 + 0.9 × 0.1 = 3.79; 1.05 / 1.21 = 86.8%)
    run.train += [TrainFigures("sdxl/b4/ours", "sdxl", 4, "ours", 2, step_s=[x + 2.0 for x in ours], first_s=9.0,
                               peak_gib=10.0, rep=1)]
    line = next(x for x in render(run).splitlines() if x.startswith("| SDXL | 1024², b4 | R1 ×2 |"))
    assert "| 1.210–3.790; 86.8% |" in line


def test_repeated_capped_arms_give_one_row_each_against_the_repeated_reference(run: GpuRun) -> None:
    run.train = [TrainFigures(f"cap/sdxl-{tag}/ours", "sdxl", 1, "ours", 1, step_s=[step] * 5, losses=[loss] * 7,
                              cap_gib=cap, peak_gib=6.0, first_s=8.0, rep=rep)
                 for tag, cap, rep, step, loss in (("none", None, 0, 1.0, 0.5), ("8", 8.0, 0, 1.2, 0.5002),
                                                   ("8", 8.0, 1, 1.0, 0.5002), ("none", None, 1, 1.2, 0.5))]
    rows = [x for x in render(run).splitlines() if x.startswith("| `cap/sdxl-")]
    # medians of medians: 1.1 each, so 100.0%; the loss difference of the first repetitions
    assert rows == ["| `cap/sdxl-none/ours` | R1 ×2 | — | 1.100 (1.000–1.200) | — | 6.0 | 8.0 | — |",
                    "| `cap/sdxl-8/ours` | R1 ×2 | 8 | 1.100 (1.000–1.200) | 100.0% | 6.0 | 8.0 | 2.00e-04 |"]


def test_the_fast_checkpoint_arm_is_shown_against_the_exact_one_and_not_in_g1(run: GpuRun) -> None:
    run.train = [TrainFigures(f"ckpt/flux-{mode}/ours", "flux", 1, "ours", 1, step_s=[step] * 5, losses=[loss] * 7,
                              peak_gib=peak, first_s=13.0, memory_plan=plan)
                 for mode, step, loss, peak, plan in (
                     ("exact", 1.0, 0.5, 26.0, "57 blocks checkpointed, …"), ("fast", 0.8, 0.5003, 26.0, ""),
                     ("kept", 0.7, 0.5, 40.0, "0 of 57 blocks checkpointed (57 kept whole in spare memory), …"))]
    text = render(run)
    lines = text.splitlines()
    rows = [x for x in lines if x.startswith("| `ckpt/flux-")]
    # fast's and kept's speed against exact: 1.0 / 0.8, 1.0 / 0.7; their losses against exact's, step by step
    assert rows == ["| `ckpt/flux-exact/ours` | R1 | 1.000 | — | 26.0 | 13.0 | — |",
                    "| `ckpt/flux-fast/ours` | R1 | 0.800 | 125.0% | 26.0 | 13.0 | 3.00e-04 |",
                    "| `ckpt/flux-kept/ours` | R1 | 0.700 | 142.9% | 40.0 | 13.0 | 0.00e+00 |"]
    assert "### G6." in text and not any(x.startswith("| Flux-dev |") for x in lines)
    g6 = lines.index("### G6. How ours checkpoints: exact, fast, blocks kept whole")
    plans = lines.index("Ours' memory plans:", g6)
    assert lines[plans + 1:plans + 3] == [  # an arm that recorded none (runs before R9) is left out
        "- `ckpt/flux-exact/ours` (R1): 57 blocks checkpointed, …",
        "- `ckpt/flux-kept/ours` (R1): 0 of 57 blocks checkpointed (57 kept whole in spare memory), …"]


def test_the_option_arms_are_shown_against_plain_in_their_own_section(run: GpuRun) -> None:
    run.train = [TrainFigures(f"options/sd15-{mode}/ours", "sd15", 1, "ours", 1, step_s=[step] * 5, losses=losses,
                              peak_gib=6.0, first_s=4.0)
                 for mode, step, losses in (("plain", 0.40, [0.5] * 7), ("ema", 0.41, [0.5] * 7),
                                            ("snr", 0.40, [0.5, 1.5, 0.5, 0.5, 0.5, 0.5, 0.5]))]
    text = render(run)
    lines = text.splitlines()
    g7 = lines.index("### G7. The step's options: gradient clipping, the weights' average, Min-SNR, part of the "
                     "layers, Prodigy, Adafactor, Lion, the 8-bit optimizers, dropout")
    rows = [x for x in lines[g7:] if x.startswith("| `options/sd15-")]
    # speed against plain (0.40 / 0.41); the average leaves the losses as they are, Min-SNR weighs them
    assert rows == ["| `options/sd15-plain/ours` | R1 | 0.400 | — | 6.0 | 4.0 | — |",
                    "| `options/sd15-ema/ours` | R1 | 0.410 | 97.6% | 6.0 | 4.0 | 0.00e+00 |",
                    "| `options/sd15-snr/ours` | R1 | 0.400 | 100.0% | 6.0 | 4.0 | 1.00e+00 |"]
    assert not any(x.startswith("| SD1.5 |") for x in lines)  # not a G1 row


def test_where_ours_first_step_went_is_listed_under_the_table(run: GpuRun, tmp_path: Path) -> None:
    ours = next(f for f in run.train if f.arm == "ours")
    ours.startup = {"data": 0.01, "model": 1.25, "memory plan": 0.8, "first step": 1.5}
    lines = render(run).splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("Where ours' first step went"))
    assert lines[at + 1] == f"- `{ours.id}` (R1): 3.56 s = data 0.01, model 1.25, memory plan 0.80, first step 1.50"
    save_run(run, tmp_path / "results.json")  # kept through the JSON; a run from before it loads with none
    assert load_run(tmp_path / "results.json") == run
    data = json.loads((tmp_path / "results.json").read_text())
    for f in data["train"]:
        f.pop("startup")
    assert all(f.startup == {} for f in run_from_dict(data).train)


def test_a_run_stopped_early_says_so_and_survives_its_json(run: GpuRun, tmp_path: Path) -> None:
    run.finished = False
    save_run(run, tmp_path / "results.json")
    again = load_run(tmp_path / "results.json")
    assert again == run
    assert "stopped before the end;" in render(again)


def test_the_placeholder_says_the_figures_are_unmeasured() -> None:
    assert PLACEHOLDER.startswith("## GPU benchmarks (`scripts/bench-gpu`)")
    assert "**Unmeasured**" in PLACEHOLDER
    doc = (Path(__file__).resolve().parents[2] / "docs" / "BENCHMARKS.md").read_text()
    assert "<!-- bench:gpu:begin -->" in doc and "<!-- bench:gpu:end -->" in doc


def test_an_arm_that_kept_device_memory_is_named_under_its_table(run: GpuRun, tmp_path: Path) -> None:
    """R4 lost ~57 GiB to a failed arm and every later arm's peak carried it; now each arm records what it left."""
    run.train[5].left_gib, run.train[5].released_gib = 57.5, 0.5  # the built-in's out-of-memory arm
    run.train[5].kept_census = "2.0 GiB in 14 tensors (frame 1.5, dict 0.5)"
    run.train[7].left_gib = 0.1  # under LEFT_GIB: allocator noise, not named
    lines = render(run).splitlines()
    at = lines.index("Arms that did not give their device memory back:")
    assert lines[at + 1] == ("- `sdxl/b4/builtin` (R1): 57.5 GiB still allocated after its clean-up (releasing the "
                             "graph autograd kept of its failed pass gave back 0.5 GiB); Python reaches 2.0 GiB in 14 "
                             "tensors (frame 1.5, dict 0.5); the arms after it in that run started with it, and their "
                             "peaks include it")
    assert not any("`cap/sdxl-8/ours` (R1): 0.1 GiB" in x for x in lines)
    save_run(run, tmp_path / "results.json")
    loaded = load_run(tmp_path / "results.json").train[5]
    assert (loaded.left_gib, loaded.kept_census) == (57.5, "2.0 GiB in 14 tensors (frame 1.5, dict 0.5)")


def test_the_census_of_a_device_counts_what_python_reaches_by_its_holder() -> None:
    """On ``meta``: a tensor held by a dict and one by a list, counted by size and holder (other tests may leave
    tensors there: what is compared is what these two add)."""
    from bench.tensor_census import census, device_census

    meta = torch.device("meta")
    total0, count0, by0 = census(meta)
    held = {"activation": torch.empty(1024, 1024, 64, device="meta")}  # 256 MiB of float32
    listed = [torch.empty(1024, 1024, 128, device="meta")]  # 512 MiB
    total, count, by = census(meta)
    assert (total - total0, count - count0) == (768 << 20, 2)
    assert (by["dict"] - by0["dict"], by["list"] - by0["list"]) == (256 << 20, 512 << 20)
    assert device_census(meta).startswith(f"{total / (1 << 30):.1f} GiB in {count} tensors (")
    del held, listed


def test_an_arm_that_keeps_memory_takes_the_census_of_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the clean-up: more than LEFT_GIB left over the arm's start takes a census; less does not."""
    import bench.gpu_train as gpu_train

    left = {"gib": 1.5}
    monkeypatch.setattr(gpu_train, "free_device", lambda device: None)
    monkeypatch.setattr(gpu_train, "allocated_gib", lambda device: left["gib"])
    kept = TrainFigures("flux/b2/builtin", "flux", 2, "builtin", 2, start_gib=0.5)
    gpu_train._clean_up(torch.device("meta"), kept)
    assert kept.left_gib == 1.0 and " GiB in " in kept.kept_census
    left["gib"] = 0.6
    fine = TrainFigures("flux/b2/ours", "flux", 2, "ours", 2, start_gib=0.5)
    gpu_train._clean_up(torch.device("meta"), fine)
    assert fine.left_gib == pytest.approx(0.1) and fine.kept_census == ""


def test_the_device_line_names_a_cuda_device_and_its_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch of ``device_info`` runs only on a GPU: here torch's CUDA queries answer as an H100's would."""
    from types import SimpleNamespace

    from bench.gpu import device_info

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda _device: SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    cuda = device_info(SimpleNamespace(type="cuda"), "0.28.0")
    cpu = device_info(SimpleNamespace(type="cpu"), "0.28.0")
    assert (cuda.kind, cuda.name, cuda.memory_gib, cuda.count, cuda.cuda, cuda.cudnn) == \
        ("cuda", "NVIDIA H100 80GB HBM3", 80.0, 2, "13.0", "91900")
    assert (cpu.kind, cpu.count, cpu.cuda, cpu.cudnn) == ("cpu", 1, "", "") and cpu.name.startswith("CPU stand-in")
    assert (cuda.torch, cuda.comfyui, cuda.python, cuda.host) == (cpu.torch, "0.28.0", cpu.python, cpu.host)


def test_each_option_group_fits_one_device_call_on_an_h100() -> None:
    """A device call runs at most 600 s and the prepared commands give the benchmark 555 of them: each family's
    option arms must fit that, as the run's own budget estimates them on an H100 (20 measured steps per arm)."""
    from bench.gpu_budget import forecast
    from bench.gpu_models import FULL_FAMILIES
    from bench.gpu_plan import plan_groups

    params = {name: spec.params_b for name, spec in FULL_FAMILIES.items()}
    groups = [g for g in plan_groups(params, {}, 79.2) if g.section == "options"]
    assert {g.key for g in groups} == {"options/sd15", "options/sdxl", "options/flux"}
    for group in groups:
        (plan,) = forecast([group], Budget(10_000, speed=1.1), 20)
        assert plan.seconds <= 555, (group.key, plan.seconds)
