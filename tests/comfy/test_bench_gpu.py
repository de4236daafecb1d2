"""``scripts/bench-gpu``'s harness on the CPU with the real ComfyUI, so it cannot rot between GPU runs.

The full-size families are built on ``meta`` only (ComfyUI's detection must name each one from the shapes, and the
parameter counts must be those the report states); the harness itself (model construction from a random state dict,
the clone factory, the cache, the bound / ours / built-in arms, Encode Dataset against ``MakeTrainingDataset``, the
profiler breakdown, the one-line skips of #25/#26's arms, the files written as it goes) runs on tiny configs of the
same classes, twice: a second run adds to the first's ledger what ``--missing`` finds left (its batch-1 row with
``--repeat 2``). Nothing here is timed: the figures' presence and shape are checked, not their values.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch
from support.pack import import_bench

import_bench()

from bench.gpu import STANDIN_SETTINGS, Options, context_from_pack, device_info, measure, tiny_specs  # noqa: E402
from bench.gpu_figures import GpuRun, load_run  # noqa: E402
from bench.gpu_ledger import load_ledger, owners  # noqa: E402
from bench.gpu_models import FULL_FAMILIES, diffusion_shapes, param_count  # noqa: E402


@pytest.mark.parametrize("name", list(FULL_FAMILIES))
def test_full_size_families_are_named_by_comfyuis_detection(name: str) -> None:
    import comfy.model_detection

    spec = FULL_FAMILIES[name]
    shapes = diffusion_shapes(spec)
    meta = {k: torch.empty(s, dtype=torch.bfloat16, device="meta") for k, s in shapes.items()}
    config = comfy.model_detection.model_config_from_unet(meta, "")
    assert config is not None
    assert type(config.get_model({}, device=torch.device("meta"))).__name__ == spec.model_class
    assert param_count(shapes) / 1e9 == pytest.approx(spec.params_b, rel=0.02)


@pytest.fixture(scope="module")
def first_run(pack: ModuleType, comfy_folders: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[GpuRun, list[str], Path]:
    """Run 1 on tiny models: SD1.5's bound and ours, WAN's built-in, one encode row, the profile, and #25's and
    #26's arms (skipped here); the ledger and the section written as it goes."""
    tmp_path = tmp_path_factory.mktemp("bench_gpu")
    lines: list[str] = []
    ctx = context_from_pack(pack, tmp_path / "work", tmp_path / "out1", lines.append)
    ctx.work.mkdir()
    ctx.ledger = tmp_path / "bench-gpu-results.json"
    families, vaes = tiny_specs()
    only = ["sd15/b1/bound", "sd15/b1/ours", "wan21/b1/builtin", "encode/sd15", "cap", "devices"]
    opts = Options(steps=2, warmup=1, budget_s=3600.0, only=only,
                   profile=True, profile_steps=1, encode_images=2, extras=False, settings=STANDIN_SETTINGS,
                   batches={"sd15": (1,), "wan21": (1,)}, command="scripts/bench-gpu --cpu-standin", commit="first")
    run = measure(ctx, opts, families, vaes, device_info(ctx.device, "test"), torch.float32)
    return run, lines, tmp_path


def test_the_harness_runs_every_part_on_tiny_models(first_run: tuple[GpuRun, list[str], Path],
                                                    comfy_folders: Path) -> None:
    run, lines, tmp_path = first_run
    out = tmp_path / "out1"
    assert run.finished and run.device.kind == "cpu" and run.commit == "first" and run.date
    by_id = {f.id: f for f in run.train}
    assert list(by_id) == ["sd15/b1/bound", "sd15/b1/ours", "wan21/b1/builtin"]
    for fig in by_id.values():
        assert fig.ok, (fig.id, fig.error, fig.skipped)
        assert len(fig.step_s) == 2 and fig.first_s is not None and fig.peak_gib is None  # no device memory here
        # ours and the bound train one step more than they time (their last report follows the one before at once),
        # and with 1 warm-up step one more again (their second report comes two steps after the first)
        assert len(fig.losses) == (3 if fig.arm == "builtin" else 5) and all(math.isfinite(x) for x in fig.losses)
        assert fig.settings["rank"] == 16 and fig.settings["training_dtype"] == "fp32"
    assert by_id["sd15/b1/ours"].data_wait_pct is not None and by_id["wan21/b1/builtin"].data_wait_pct is None
    # the plan ours and the bound trained with (the CPU's memory free is its RAM: every block kept whole)
    for arm in ("bound", "ours"):
        assert " blocks checkpointed (" in by_id[f"sd15/b1/{arm}"].memory_plan
    assert by_id["wan21/b1/builtin"].memory_plan == ""
    # where ours' first step went, as the trainer times it: within the arm's own time to its first step report
    for arm in ("bound", "ours"):
        fig = by_id[f"sd15/b1/{arm}"]
        assert list(fig.startup)[:3] == ["data", "model", "memory plan"] and list(fig.startup)[-1] == "first step"
        assert fig.first_s is not None and 0 < sum(fig.startup.values()) <= fig.first_s
    assert by_id["wan21/b1/builtin"].startup == {}
    assert set(run.builds) == {"sd15", "wan21"}

    (row,) = run.encode
    assert not row.error and row.ours_s and row.builtin_s and row.images == 2
    # the releases, timed on both sides (on the CPU there is nothing to move: ComfyUI's encoders stay put)
    assert row.ours_release_s is not None and 0 <= row.ours_release_s < row.ours_s
    assert row.builtin_release_s is not None and row.builtin_release_s >= 0
    # where ours' seconds went: the plan, the run, and the run's own timings, within the row's wall time
    phases = row.ours_phases
    assert {"plan", "run", "encoder", "commit", "finish"} <= phases.keys()
    assert 0 < phases["encoder"] <= phases["run"] and phases["plan"] + phases["run"] <= row.ours_s

    # each family's selected arms at its first batch: SD1.5's bound and ours, WAN's built-in alone
    assert [p.id for p in run.profile] == ["profile/sd15/b1/bound", "profile/sd15/b1/ours", "profile/wan21/b1/builtin"]
    for prof in run.profile:
        assert not prof.error and prof.steps == 1 and prof.step_ms > 0 and prof.top_ops
        assert prof.events > 0 and prof.trace.endswith(".json.gz")  # read from kineto's raw events; small: kept
    assert all("streamcache.model_call" in p.labels_ms for p in run.profile[:2])
    assert "streamcache.next_batch" in run.profile[1].labels_ms
    assert not any(label.startswith("streamcache.") for label in run.profile[2].labels_ms)  # none of ours in it

    # #25's and #26's arms: selected, and skipped with one line each (no `memory` setting yet, or no CUDA device
    # to cap; one device here)
    assert sum(n.startswith("Memory-capped arms (#25") and "skipped" in n for n in run.notes) == 1
    assert any(n.startswith("Multi-GPU arms (#26): skipped") for n in run.notes)
    assert any(n.startswith("Page cache before ours: ") for n in run.notes)
    # the plan, printed before the first figure: the three groups that run (the rest was not selected)
    start = next(i for i, x in enumerate(lines) if x.startswith("plan (3600 s budget):"))
    assert [x.split()[:2] for x in lines[start + 1:start + 4]] == [["run", "sd15/b1"], ["run", "wan21/b1"],
                                                                   ["run", "encode/sd15"]]
    assert lines[start + 4].startswith("  expected: 3 of 3 groups in ~") and "building the model" in lines[start + 5]

    saved = load_run(out / "results.json")
    assert [f.id for f in saved.train] == list(by_id) and saved.finished
    section = (out / "section.md").read_text()
    assert section.startswith("## GPU benchmarks (`scripts/bench-gpu`)")
    assert "| SD1.5 (tiny) | 64², b1 | R1 | 1 |" in section and "- **R1** " in section
    assert "| WAN 2.1 (tiny) | 9 frames 64², b1 | R1 | 1 | — | — |" in section  # its built-in arm alone
    enc = next(x for x in section.splitlines() if x.startswith("| SD1.5 (SD VAE, CLIP-L) | R1 | 2 × 64×64 |"))
    # encode-only and with-release figures for both, their ratios, both releases (free memory: none on a CPU)
    assert "—" not in "|".join(enc.split("|")[1:8]) and enc.endswith("| — | — | — / — |")
    assert json.loads((out / "results.json").read_text())["device"]["kind"] == "cpu"
    # both sides ran once untimed before the timed pair (their folder and cache are gone again)
    assert saved.encode[0].warmup_s is not None and saved.encode[0].warmup_s > 0
    assert not any(p.name.endswith("_warmup") for p in comfy_folders.rglob("bench_gpu_*"))
    assert any(line.startswith("sd15/b1/ours (depth 1): median") for line in lines)
    ledger = load_ledger(tmp_path / "bench-gpu-results.json")
    assert [r.number for r in ledger.runs] == [1]
    assert group_keys(ledger) == {"sd15/b1": 1, "wan21/b1": 1, "encode/sd15": 1, "profile/sd15/b1/bound": 1,
                                  "profile/sd15/b1/ours": 1, "profile/wan21/b1/builtin": 1}


def group_keys(ledger: object) -> dict[str, int]:
    return {k: run.number for k, (run, _) in owners(ledger.runs).items()}  # type: ignore[attr-defined]


def test_a_second_run_measures_what_the_first_left_and_adds_to_it(
        pack: ModuleType, first_run: tuple[GpuRun, list[str], Path]) -> None:
    first, _, tmp_path = first_run
    lines: list[str] = []
    ctx = context_from_pack(pack, tmp_path / "work", tmp_path / "out2", lines.append)
    ctx.ledger = tmp_path / "bench-gpu-results.json"
    ctx.base = load_ledger(ctx.ledger)
    families, vaes = tiny_specs()
    # --missing within SD1.5's batch-1 row, which the first run left partial (its built-in arm was not selected);
    # "sd15" alone would select the family's checkpoint-mode and option groups too (ckpt/sd15, options/sd15)
    opts = Options(steps=1, warmup=1, budget_s=3600.0, only=["sd15/b1"], missing=True, repeat=2, extras=False,
                   settings=STANDIN_SETTINGS, batches={"sd15": (1,), "wan21": (1,)},
                   command="scripts/bench-gpu --cpu-standin --missing --repeat 2", commit="second")
    run = measure(ctx, opts, families, vaes, device_info(ctx.device, "test"), torch.float32)

    said = next(x for x in lines if x.startswith("--missing: "))
    assert "sd15/b1" in said and "wan21/b1" in said and "flux/b1" in said and "encode/sd15" not in said
    assert [(f.id, f.rep) for f in run.train] == [
        ("sd15/b1/bound", 0), ("sd15/b1/ours", 0), ("sd15/b1/builtin", 0),
        ("sd15/b1/ours", 1), ("sd15/b1/builtin", 1), ("sd15/b1/bound", 1)]
    assert all(f.ok and len(f.step_s) == 1 for f in run.train) and run.repeat == 2 and not run.encode

    ledger = load_ledger(ctx.ledger)
    assert [(r.number, r.commit) for r in ledger.runs] == [(1, "first"), (2, "second")]
    assert group_keys(ledger) == {"sd15/b1": 2, "wan21/b1": 1, "encode/sd15": 1, "profile/sd15/b1/bound": 1,
                                  "profile/sd15/b1/ours": 1, "profile/wan21/b1/builtin": 1}
    assert [f.id for f in ledger.runs[0].train] == ["wan21/b1/builtin"]  # R1's SD1.5 arms were replaced
    assert ledger.runs[0].encode == first.encode and ledger.runs[0].profile == first.profile
    section = (tmp_path / "out2" / "section.md").read_text()
    assert "| SD1.5 (tiny) | 64², b1 | R2 ×2 | 1 |" in section
    assert "| WAN 2.1 (tiny) | 9 frames 64², b1 | R1 | 1 |" in section
    assert "- **R1** " in section and "- **R2** " in section and "rows ×2" in section
    pending = next(x for x in section.splitlines() if x.startswith("Still without figures"))
    assert "`flux/b1`" in pending and "`wan21/b1`" in pending and "`sd15/b1`" not in pending


def test_the_option_arms_train_with_their_settings_against_plain(pack: ModuleType, comfy_folders: Path,
                                                                  tmp_path: Path) -> None:
    """The step-options group (G7) on tiny SD1.5: its arms reach Train LoRA with their settings, train, and are shown
    against plain; Min-SNR weighs the losses, the average leaves them as plain's; Prodigy trains at rate 1; Adafactor
    and dropout train another LoRA."""
    lines: list[str] = []
    ctx = context_from_pack(pack, tmp_path / "work", tmp_path / "out", lines.append)
    ctx.work.mkdir()
    families, vaes = tiny_specs()
    only = ["options/sd15-plain", "options/sd15-ema", "options/sd15-all", "options/sd15-prodigy",
            "options/sd15-adafactor", "options/sd15-dropout"]
    opts = Options(steps=2, warmup=1, budget_s=3600.0, only=only, extras=False, settings=STANDIN_SETTINGS,
                   command="scripts/bench-gpu --cpu-standin", commit="x")
    run = measure(ctx, opts, families, vaes, device_info(ctx.device, "test"), torch.float32)

    by_id = {f.id: f for f in run.train}
    assert list(by_id) == ["options/sd15-plain/ours", "options/sd15-ema/ours", "options/sd15-all/ours",
                           "options/sd15-prodigy/ours", "options/sd15-adafactor/ours", "options/sd15-dropout/ours"]
    assert all(f.ok and len(f.step_s) == 2 for f in by_id.values()), [(f.id, f.error) for f in by_id.values()]
    plain, ema, every = (by_id[f"options/sd15-{m}/ours"] for m in ("plain", "ema", "all"))
    assert "max_grad_norm" not in plain.settings and ema.settings["ema_decay"] == 0.999
    assert (every.settings["max_grad_norm"], every.settings["min_snr_gamma"]) == (1.0, 5.0)
    prodigy = by_id["options/sd15-prodigy/ours"]
    assert (prodigy.settings["optimizer"], prodigy.settings["learning_rate"]) == ("Prodigy", 1.0)
    adafactor, dropout = by_id["options/sd15-adafactor/ours"], by_id["options/sd15-dropout/ours"]
    assert adafactor.settings["optimizer"] == "Adafactor"
    assert (dropout.settings["rank_dropout"], dropout.settings["module_dropout"]) == (0.1, 0.1)
    assert adafactor.losses[0] == plain.losses[0] and dropout.losses[0] == plain.losses[0]  # the same first LoRA
    # (a new LoRA's downs are 0, so its first forward is the base model's whatever the dropout: the losses part
    # from the second step on, where the optimizers and the masks have acted)
    assert adafactor.losses != plain.losses and dropout.losses != plain.losses
    # the same seed and batches: the average is not what trains, so the losses are plain's exactly; Min-SNR's
    # weights (min(SNR, 5) of each drawn noise level) change them
    assert ema.losses == plain.losses and every.losses != plain.losses
    section = (tmp_path / "out" / "section.md").read_text()
    rows = [x for x in section.splitlines() if x.startswith("| `options/sd15-")]
    assert [r.split(" | ")[0] for r in rows] == [f"| `{i}`" for i in by_id]
    assert rows[0].split(" | ")[3] == "—" and rows[2].split(" | ")[3].endswith("%")


def test_each_arm_starts_without_a_remembered_probe(pack: ModuleType, comfy_folders: Path, tmp_path: Path) -> None:
    """Train LoRA remembers its memory probe's result within a process; the benchmark forgets it before every arm,
    so each arm's first step includes the probe (as a model's first run in a fresh ComfyUI does) and the arm that
    runs second is not favoured."""
    from bench.gpu_train import forget_probes

    probe = importlib.import_module(f"{pack.__name__}.nodes.training.probe")
    ctx = context_from_pack(pack, tmp_path / "work", tmp_path / "out", print)
    probe.PROBES.put("a key", "a result")
    assert "a key" in probe.PROBES.keys()
    forget_probes(ctx.trainers)
    assert len(probe.PROBES) == 0


def test_a_failed_arm_gives_back_the_graph_autograd_kept(pack: ModuleType, comfy_folders: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An arm that fails in a backward pass (the built-in out of memory at Flux b2 in R4) must not leave its graph
    to the arms after it: run_arm releases what autograd keeps of it (dataset_cache/autograd_release.py)."""
    import gc
    import weakref

    import bench.gpu_train as gpu_train
    from bench.gpu_figures import TrainFigures
    from support.failed_backward import failing_backward

    refs: list[weakref.ref[torch.Tensor]] = []
    monkeypatch.setattr(gpu_train, "builtin_steps", lambda *args, **kwargs: failing_backward(refs))
    ctx = context_from_pack(pack, tmp_path / "work", tmp_path / "out", print)
    fig = TrainFigures("sd15/b1/builtin", "sd15", 1, "builtin", 1)
    gpu_train.run_arm(ctx.trainers, None, None, fig, 2, 1, dict(STANDIN_SETTINGS), say=lambda line: None)  # type: ignore[arg-type]
    assert fig.error.startswith("RuntimeError: hook 'engine_error' has changed the size")
    gc.collect()
    assert refs and refs[0]() is None
