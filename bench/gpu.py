"""``scripts/bench-gpu``: the pack on one CUDA GPU against the in-memory bound and ComfyUI's own nodes, in one process.

Builds full-size random-weight models from ComfyUI's classes (:mod:`bench.gpu_models`), a real cache of each
family's sample shapes (:mod:`bench.gpu_data`), and measures side by side the groups of :mod:`bench.gpu_plan`
(training: :mod:`bench.gpu_train`; Encode Dataset: :mod:`bench.gpu_encode`; ``--profile``: :mod:`bench.gpu_profile`)
inside a time budget (:mod:`bench.gpu_budget`; default 7.5 min, for 8 on one H100). It prints the plan first (what
should run, what should not fit), then each figure as it comes, and after each one rewrites ``results.json`` (this
run) and ``section.md`` in the output folder, the ledger of accumulated runs (``docs/bench-gpu-results.json``,
:mod:`bench.gpu_ledger`) and the GPU section of docs/BENCHMARKS.md (:mod:`bench.gpu_report`): a run stopped by a time
limit still leaves its figures, and the figures of earlier runs that this one did not measure again stay.

    scripts/bench-gpu                      # everything the budget allows, ~8 min on one H100
    scripts/bench-gpu --missing            # only what the earlier runs left (what scripts/device-run runs)
    scripts/bench-gpu --quick              # 1 warm-up + 5 steps, fewer images
    scripts/bench-gpu --only flux/ours,sd15/b8,encode --no-doc
    scripts/bench-gpu --repeat 3 --only sdxl/b4   # each selected row's arms 3 times in turn
    scripts/bench-gpu --profile --only sdxl
    scripts/bench-gpu --merge out/device/results.json   # add a GPU run's results to the ledger and the doc
    scripts/bench-gpu --render             # the doc's section again from the ledger (after a change of the report)
    scripts/bench-gpu --cpu-standin        # the harness on tiny models on the CPU (what the CPU test runs)

Without a CUDA GPU it says so in one line and exits 0 (``--cpu-standin``, ``--merge`` and ``--render`` aside).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from .gpu_budget import Budget, RunState, describe_forecast, device_factor, encode_reserve, forecast
from .gpu_docs import LEDGER_NAME, checkout_commit, merge_results, plan_of, render_doc
from .gpu_figures import Device, EncodeFigures, GpuRun, TrainFigures, save_run
from .gpu_ledger import Ledger, group_state, identity, load_ledger, merge, missing, owners, run_groups, save_ledger
from .gpu_models import FULL_FAMILIES, FULL_VAES, FamilySpec, VaeSpec
from .gpu_plan import STEP_OPTION_ARMS, ArmPlan, GroupPlan, select
from .gpu_report import SECTION, render

__all__ = ["Options", "Context", "measure", "main", "context_from_pack", "tiny_specs"]

PROG = "scripts/bench-gpu"
DEFAULT_BUDGET_S = 450.0


@dataclass
class Options:
    """What one run measures (resolved from the command line, or set by the CPU test)."""

    steps: int = 20
    warmup: int = 3
    budget_s: float = DEFAULT_BUDGET_S
    only: list[str] = field(default_factory=list)
    profile: bool = False
    profile_steps: int = 3
    encode_images: int = 24
    depth: int | None = None
    extras: bool = True
    """Qwen-Image and Lumina 2 after the rest, where the budget allows."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Training options every arm gets on top of the shared ones (the CPU stand-in: fp32)."""
    batches: dict[str, tuple[int, ...]] | None = None
    """Batch sizes per family instead of :data:`bench.gpu_plan.BATCHES` (the CPU test keeps them small)."""
    command: str = PROG
    missing: bool = False
    """Only the groups the earlier runs (:attr:`Context.base`) left without figures, or partial, skipped, failed."""
    repeat: int = 1
    """Each selected training row's arms (capped and multi-GPU groups included; encode rows and profiles once)
    this many times, in turn (:func:`bench.gpu_plan.rounds`)."""
    commit: str = ""
    """The code measured (:func:`checkout_commit`)."""


@dataclass
class Context:
    """Where the run happens: the trainers (:class:`bench.gpu_train.Trainers`), our Encode Dataset node class,
    ComfyUI's input folder, a scratch folder, the output folder, and the progress printer."""

    trainers: Any
    encode_node: type
    input_dir: Path
    work: Path
    out: Path
    say: Callable[[str], None]
    doc: Path | None = None
    """The doc whose GPU section is rewritten after each figure (``None``: only ``out/section.md``)."""
    ledger: Path | None = None
    """Where the accumulated runs are rewritten after each figure (``None``: nowhere)."""
    base: Ledger = field(default_factory=Ledger)
    """The earlier runs this one adds to (``--missing`` selects what they left)."""

    @property
    def device(self) -> Any:
        return self.trainers.device


def context_from_pack(pack: ModuleType, work: Path, out: Path, say: Callable[[str], None]) -> Context:
    """A :class:`Context` from the imported pack (as ComfyUI imports it) and ComfyUI's configured folders."""
    import importlib

    import comfy.model_management
    import folder_paths

    from .gpu_train import Trainers

    loop = importlib.import_module(f"{pack.__name__}.nodes.training")
    run = importlib.import_module(f"{pack.__name__}.nodes.training.run")  # it makes the loader
    handles = importlib.import_module(f"{pack.__name__}.nodes.handles")
    encode = importlib.import_module(f"{pack.__name__}.nodes.encode_dataset")
    trainers = Trainers(loop, handles, loop.nodes_train_module(), _nodes_dataset(),
                        comfy.model_management.get_torch_device(), run)
    return Context(trainers, encode.EncodeDataset, Path(folder_paths.get_input_directory()), work, out, say)


def _nodes_dataset() -> ModuleType:
    """ComfyUI's live ``comfy_extras/nodes_dataset`` (found through its registered node, else imported)."""
    import importlib

    nodes = sys.modules.get("nodes")
    cls = getattr(nodes, "NODE_CLASS_MAPPINGS", {}).get("MakeTrainingDataset") if nodes else None
    module = sys.modules.get(cls.__module__) if cls is not None else None
    return module or importlib.import_module("comfy_extras.nodes_dataset")


# ------------------------------------------------------------------------------------------------ the device
def device_info(device: Any, comfyui: str) -> Device:
    """Name, memory and versions of ``device`` (the CPU stand-in: the host's RAM)."""
    import torch

    from .common import machine_info

    m = machine_info()
    host = f"{m.cpu}, {m.cores} cores, {m.ram} RAM"
    common = Device("cpu", f"CPU stand-in ({m.cpu})", 0.0, torch=torch.__version__, comfyui=comfyui,
                    python=platform.python_version(), host=host)
    if getattr(device, "type", "cpu") == "cuda":
        props = torch.cuda.get_device_properties(device)
        cudnn = torch.backends.cudnn.version()
        return dataclasses.replace(common, kind="cuda", name=props.name, memory_gib=props.total_memory / 2**30,
                                   count=torch.cuda.device_count(), cuda=torch.version.cuda or "",
                                   cudnn=str(cudnn or ""))
    return common


# ------------------------------------------------------------------------------------------------ measuring
class _Recorder:
    """Adds figures to the run and, after each one, rewrites results.json (this run), and section.md, the ledger
    and the doc's section (the earlier runs merged with this one so far)."""

    def __init__(self, run: GpuRun, ctx: Context, families: dict[str, FamilySpec], start: float,
                 keys: list[str]) -> None:
        self.run, self.ctx, self.families, self.start, self.keys = run, ctx, families, start, keys

    def merged(self) -> Ledger:
        return merge(self.ctx.base, self.run)

    def save(self) -> None:
        self.run.seconds = time.perf_counter() - self.start
        save_run(self.run, self.ctx.out / "results.json")
        ledger = self.merged()
        text = render(ledger, self.families, pending=missing(ledger, self.keys))
        (self.ctx.out / "section.md").write_text(text)
        if self.ctx.ledger is not None:
            save_ledger(ledger, self.ctx.ledger)
        if self.ctx.doc is not None:  # as it goes: a run stopped by a time limit leaves its figures in the doc
            from .report import update_doc

            update_doc(self.ctx.doc, SECTION, text)

    def note(self, line: str) -> None:
        self.run.notes.append(line)
        self.ctx.say(line)
        self.save()


def measure(ctx: Context, opts: Options, families: dict[str, FamilySpec], vaes: dict[str, VaeSpec],
            device: Device, dtype: Any = None) -> GpuRun:
    """Run the selected groups in the plan's order within the budget; the figures (also written as they come)."""
    import torch

    from .gpu_train import ours_steps

    dtype = dtype or torch.bfloat16
    start = time.perf_counter()
    budget = Budget(opts.budget_s, start, speed=device_factor(device.name) if device.kind == "cuda" else 1.0)
    run = GpuRun(device, opts.command, opts.steps, opts.warmup, opts.budget_s,
                 date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), commit=opts.commit, repeat=opts.repeat)
    everything = _plan(opts, families, vaes, device)
    rec = _Recorder(run, ctx, families, start, [g.key for g in everything])
    ctx.out.mkdir(parents=True, exist_ok=True)
    groups = _runnable(ctx, opts, rec, device, everything)
    total = ours_steps(opts.warmup, opts.steps)  # ours and the bound train more steps than they time
    for line in describe_forecast(forecast(groups, budget, total, opts.encode_images), budget.left()):
        ctx.say(line)
    reserve = encode_reserve(groups, budget, total, opts.encode_images)
    if reserve:
        budget.reserve("encode", reserve)
    state = RunState()
    for part in _passes(groups):
        if part[0].section != "main":
            budget.release("encode")
        if part[0].section == "encode":
            _encode_pass(ctx, opts, rec, budget, state, part, vaes)
            continue
        family = part[0].family
        spec = families.get(family) or families.get(family.removesuffix("_fp8"))
        if spec is not None:
            fam_dtype = torch.float8_e4m3fn if family.endswith("_fp8") else dtype
            _family_pass(ctx, opts, rec, budget, state, spec, part, fam_dtype, name=family)
    run.finished = True
    rec.save()
    kept = owners(rec.merged().runs)
    for key, figs in run_groups(run).items():  # what this run measured but the merge did not take
        if key in kept and identity(kept[key][0]) != identity(run):
            ctx.say(f"{key}: {group_state(key, figs)} here, R{kept[key][0].number}'s figures kept")
    return run


def _plan(opts: Options, families: dict[str, FamilySpec], vaes: dict[str, VaeSpec], device: Device
          ) -> list[GroupPlan]:
    return plan_of(device, families, vaes, batches=opts.batches, depth=opts.depth, repeat=opts.repeat,
                   extras=opts.extras)


def _runnable(ctx: Context, opts: Options, rec: _Recorder, device: Device, everything: list[GroupPlan]
              ) -> list[GroupPlan]:
    """The groups ``--only`` and ``--missing`` select; #25's capped and #26's multi-GPU groups this checkout and
    machine cannot run are left out with one line each."""
    from .gpu_train import missing_settings

    keys = None
    if opts.missing:
        keys = set(missing(ctx.base, [g.key for g in everything]))
        ctx.say(f"--missing: {len(keys)} of {len(everything)} groups without figures in the earlier runs "
                f"({len(ctx.base.runs)}): " + (", ".join(g.key for g in everything if g.key in keys) or "none"))
    groups = select(everything, opts.only, keys)
    if any(g.section == "cap" for g in groups):
        if missing_settings(ctx.trainers, {"memory": "auto"}):
            rec.note("Memory-capped arms (#25: SDXL in 8 GB, Flux-dev in 24 and 12 GB, WAN in 12 GB): skipped, this "
                     "checkout's Train LoRA has no `memory` setting yet.")
            groups = [g for g in groups if g.section != "cap"]
        elif device.kind != "cuda":
            rec.note("Memory-capped arms (#25): skipped, no CUDA device to cap.")
            groups = [g for g in groups if g.section != "cap"]
    if any(g.section == "ckpt" for g in groups) and missing_settings(ctx.trainers, {"checkpoint_mode": "fast"}):
        rec.note("Checkpoint-mode arms: skipped, this checkout's Train LoRA has no `checkpoint_mode` setting yet.")
        groups = [g for g in groups if g.section != "ckpt"]
    options = {k: v for arm in STEP_OPTION_ARMS.values() for k, v in arm.items()}
    if any(g.section == "options" for g in groups) and missing_settings(ctx.trainers, options):
        rec.note("Step-option arms (G7): skipped, this checkout's Train LoRA lacks "
                 + ", ".join(f"`{n}`" for n in missing_settings(ctx.trainers, options)) + ".")
        groups = [g for g in groups if g.section != "options"]
    if any(g.section == "devices" for g in groups):
        count = device.count if device.kind == "cuda" else 0
        if count < 2:
            rec.note(f"Multi-GPU arms (#26): skipped, {count or 'no'} CUDA GPU here (they need 2 or more).")
            groups = [g for g in groups if g.section != "devices"]
        elif missing_settings(ctx.trainers, {"devices": "auto"}):
            rec.note("Multi-GPU arms (#26): skipped, this checkout's Train LoRA has no `devices` setting yet.")
            groups = [g for g in groups if g.section != "devices"]
    return groups


def _passes(groups: list[GroupPlan]) -> list[list[GroupPlan]]:
    """Consecutive groups that share a model (a family's batches; a capped family's arms) or the text encoders (the
    encode rows): one pass each."""
    out: list[list[GroupPlan]] = []
    for g in groups:
        same = out and out[-1][0].section == g.section and (g.section == "encode" or out[-1][0].family == g.family)
        if same:
            out[-1].append(g)
        else:
            out.append([g])
    return out


def _family_pass(ctx: Context, opts: Options, rec: _Recorder, budget: Budget, state: RunState, spec: FamilySpec,
                 groups: list[GroupPlan], dtype: Any, name: str) -> None:
    """Build ``spec``'s model and data once (when a first group fits), then run each group's arms that fit."""
    from .gpu_data import drop_page_cache, write_family_cache
    from .gpu_train import ours_steps, run_arm

    total = ours_steps(opts.warmup, opts.steps)
    built: tuple[Any, Any] | None = None
    root = ctx.work / f"cache_{name}"
    try:
        for group in groups:
            state.enter(group)
            cost = budget.group_cost(group, total, state)
            if not budget.fits(cost):
                for arm in group.arms:
                    _skip(rec, arm, budget.why_not(cost))
                continue
            if built is None:
                samples = max(a.batch for g in groups for a in g.arms) * total
                built = _build(ctx, rec, spec, name, dtype, root, samples, write_family_cache)
            model, data = built
            for arm in group.arms:
                first = not state.warm
                cost = budget.arm_cost(arm, total, first=first)
                if not budget.fits(cost, reserved=False):  # a group under way may use what later sections keep
                    _skip(rec, arm, budget.why_not(cost))
                    continue
                fig = TrainFigures(arm.id, name, arm.batch, arm.arm, arm.depth, arm.depth_note, cap_gib=arm.cap_gib,
                                   rep=arm.rep)
                if arm.arm == "ours":
                    method = drop_page_cache(root)
                    if f"Page cache before ours: {method}" not in rec.run.notes:
                        rec.run.notes.append(f"Page cache before ours: {method}")
                run_arm(ctx.trainers, model, data, fig, opts.steps, opts.warmup, {**opts.settings, **arm.extra},
                        say=ctx.say)
                rec.run.train.append(fig)
                budget.learn(arm, total, fig.median_s, fig.wall_s, first=first)
                state.warm = True
                rec.save()
            state.ran(group)
        if opts.profile and built is not None:
            _profile_pass(ctx, opts, rec, budget, built[0], built[1], list(groups[0].arms))
    finally:
        model = data = built = None  # the last references: the model's memory goes with them
        _free(ctx, root)


def _build(ctx: Context, rec: _Recorder, spec: FamilySpec, name: str, dtype: Any, root: Path, samples: int,
           write: Callable[..., Any]) -> tuple[Any, Any]:
    from .gpu_models import build_diffusion_model

    ctx.say(f"{name}: building the model ({spec.params_b:g}B parameters) and a cache of its samples")
    t = time.perf_counter()
    model = build_diffusion_model(spec, ctx.device, dtype)
    data = write(spec, root, samples)
    rec.run.builds[name] = time.perf_counter() - t
    ctx.say(f"{name}: ready in {rec.run.builds[name]:.0f} s (cache {data.bytes / 2**20:.0f} MiB, "
            f"{data.samples} samples)")
    return model, data


def _free(ctx: Context, root: Path) -> None:
    from .gpu_train import free_device

    free_device(ctx.device)
    gc.collect()
    shutil.rmtree(root, ignore_errors=True)


PROFILE_SKIP = 2
"""Steps before the profiler records (model load and the first kernels' set-up are not a step's cost)."""


def _profile_pass(ctx: Context, opts: Options, rec: _Recorder, budget: Budget, model: Any, data: Any,
                  arms: list[ArmPlan]) -> None:
    """``--profile``: a few steps of the bound, ours and the built-in at the family's first batch, with their
    breakdown; one that should not fit the budget (:meth:`Budget.profile_cost`: the profiler's own cost included) is
    skipped with a note, and one under way is stopped at the budget's end (:func:`bench.gpu_profile.profile_arm`)."""
    from .gpu_profile import MAX_TRACE_BYTES, describe, failed, profile_arm

    for arm in [a for a in arms if a.arm in ("bound", "ours", "builtin") and a.batch == arms[0].batch
                and a.rep == 0][:3]:
        cost = budget.profile_cost(arm, PROFILE_SKIP, opts.profile_steps, MAX_TRACE_BYTES)
        if not budget.fits(cost.seconds):
            rec.note(f"profile {arm.id}: skipped, {budget.why_not(cost.seconds)} ({cost.describe()})")
            continue
        fig_id, t0 = f"profile/{arm.id}", time.perf_counter()
        # saved before it starts: a run stopped during the profile says so, beside every figure before it
        rec.run.profile.append(failed(fig_id, f"started at {t0 - rec.start:.0f} s of the run, expected to take "
                                              f"~{cost.seconds:.0f} s ({cost.describe()}); the run ended first"))
        rec.save()
        fig = TrainFigures(fig_id, arm.family, arm.batch, arm.arm, arm.depth)
        prof = profile_arm(ctx.trainers, model, data, fig, PROFILE_SKIP, cost.active,
                           ctx.out if cost.trace else None, opts.settings, deadline=t0 + budget.left())
        rec.run.profile[-1] = prof
        ctx.say(f"{describe(prof)} ({cost.describe()}: ~{cost.seconds:.0f} s expected, "
                f"{time.perf_counter() - t0:.0f} s taken)")
        rec.save()


def _skip(rec: _Recorder, arm: ArmPlan, why: str) -> None:
    fig = TrainFigures(arm.id, arm.family, arm.batch, arm.arm, arm.depth, arm.depth_note, skipped=why,
                       cap_gib=arm.cap_gib, rep=arm.rep)
    rec.run.train.append(fig)
    rec.ctx.say(f"{arm.id}{f' (repeat {arm.rep + 1})' if arm.rep else ''}: skipped, {why}")
    rec.save()


def _encode_pass(ctx: Context, opts: Options, rec: _Recorder, budget: Budget, state: RunState,
                 groups: list[GroupPlan], vaes: dict[str, VaeSpec]) -> None:
    """Encode Dataset vs MakeTrainingDataset per VAE row, with the text encoders built once."""
    import torch

    from .gpu_encode import run_encode_row
    from .gpu_models import build_text_encoder, build_vae, random_state_dict, text_encoder_shapes
    from .gpu_train import free_device

    clips: dict[str, Any] = {}
    clip_l = None
    for group in groups:
        spec = vaes[group.family]
        state.enter(group)
        est = budget.group_cost(group, 0, state, opts.encode_images)
        if not budget.fits(est):
            fig = EncodeFigures(group.key, spec.title, opts.encode_images, spec.size, skipped=budget.why_not(est))
            rec.run.encode.append(fig)
            ctx.say(f"{fig.id}: skipped, {fig.skipped}")
            rec.save()
            continue
        try:
            if clip_l is None:
                clip_l = random_state_dict(text_encoder_shapes("clip_l"), torch.float16, ctx.device, 5)
            if spec.text not in clips:
                ctx.say(f"encode: building the text encoder {spec.text}")
                clips[spec.text] = build_text_encoder(spec.text, ctx.device, clip_l=clip_l)
            vae = build_vae(spec, ctx.device)
        except Exception as exc:  # a model that cannot be built is a figure of the run
            fig = EncodeFigures(group.key, spec.title, opts.encode_images, spec.size,
                                error=f"building the encoders: {type(exc).__name__}: {str(exc)[:300]}")
            rec.run.encode.append(fig)
            ctx.say(f"{fig.id}: FAILED {fig.error}")
            rec.save()
            continue
        fig = run_encode_row(spec, vae, clips[spec.text], ctx.encode_node, ctx.trainers.nodes_dataset,
                             ctx.input_dir, opts.encode_images, ctx.device, say=ctx.say)
        rec.run.encode.append(fig)
        state.ran(group)
        del vae
        rec.save()
    clips.clear()
    free_device(ctx.device)


# ------------------------------------------------------------------------------------------------ CPU stand-in
STANDIN_SETTINGS = {"training_dtype": "fp32", "lora_dtype": "fp32"}
"""The CPU stand-in trains in fp32 (bf16 autocast on a CPU takes seconds a step even for tiny models)."""
STANDIN_BATCHES = {"sd15": (1, 2), "flux": (1,), "wan21": (1,)}

def tiny_specs() -> tuple[dict[str, FamilySpec], dict[str, VaeSpec]]:
    """Tiny configs of the same classes (``tests/support/tiny_families``) for the CPU stand-in: SD1.5, Flux and
    WAN 2.1 (video latents of 3 frames), and encode rows with the SD VAE and a WAN VAE of width 16, CLIP-L only."""
    from support.tiny_families import FAMILIES

    fams = {
        "sd15": FamilySpec("sd15", "SD1.5 (tiny)", FAMILIES["sd15"].model_class, FAMILIES["sd15"].unet_config,
                           (1, 4, 8, 8), 77, 768, shape_note="64²", params_b=0.0),
        "flux": FamilySpec("flux", "Flux (tiny)", FAMILIES["flux"].model_class, FAMILIES["flux"].unet_config,
                           (1, 16, 8, 8), 16, 4096, pooled=768, extras={"guidance": 3.5}, shape_note="64²"),
        "wan21": FamilySpec("wan21", "WAN 2.1 (tiny)", FAMILIES["wan21"].model_class, FAMILIES["wan21"].unet_config,
                            (1, 16, 3, 8, 8), 16, 4096, shape_note="9 frames 64²"),
    }
    vaes = {"sd15": dataclasses.replace(FULL_VAES["sd15"], size=(64, 64)),
            "wan21": dataclasses.replace(FULL_VAES["wan21"], size=(64, 96), text="clip_l", wan_dim=16,
                                         title="WAN 2.1 (WAN VAE of width 16, images as 1 frame, CLIP-L)")}
    return fams, vaes


# ------------------------------------------------------------------------------------------------ command line
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 warm-up + 5 steps per arm, 8 images per encode row")
    ap.add_argument("--only", default="", help="comma-separated FAMILY[/bB][/ARM] patterns (e.g. flux/ours,encode)")
    ap.add_argument("--missing", action="store_true",
                    help="only the groups the ledger has no figures for (or partial, skipped, failed ones)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each selected training row's arms N times in turn (default 1; encode rows once)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per arm (default 20)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per arm (default 3)")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for the whole run (%(default)s)")
    ap.add_argument("--depth", type=int, choices=(1, 2), default=None, help="checkpoint_depth for every arm")
    ap.add_argument("--images", type=int, default=None, help="images per encode row (default 24)")
    ap.add_argument("--profile", action="store_true",
                    help="torch.profiler breakdown of the bound, ours and the built-in")
    ap.add_argument("--no-extras", action="store_true", help="leave out Qwen-Image and Lumina 2")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default out/bench-gpu)")
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: temporary, deleted)")
    ap.add_argument("--doc", type=Path, default=None, help="markdown file to update (default docs/BENCHMARKS.md)")
    ap.add_argument("--ledger", type=Path, default=None,
                    help=f"the accumulated runs (default: {LEDGER_NAME} beside the doc)")
    ap.add_argument("--no-doc", action="store_true", help="write neither the doc nor the ledger")
    ap.add_argument("--merge", type=Path, default=None, metavar="RESULTS_JSON",
                    help="no measuring: add a run's results.json to the ledger and rewrite the doc's section")
    ap.add_argument("--render", action="store_true",
                    help="no measuring: rewrite the doc's section from the ledger (after a change of the report)")
    ap.add_argument("--run-date", default="", help="with --merge: the run's date, where its results.json has none")
    ap.add_argument("--run-commit", default="", help="with --merge: the code it measured, where its results.json "
                    "has none")
    ap.add_argument("--cpu-standin", action="store_true", help="the harness on tiny models on the CPU")
    return ap


def options_from(a: argparse.Namespace, argv: Sequence[str]) -> Options:
    return Options(
        steps=a.steps or (5 if a.quick else 20), warmup=a.warmup if a.warmup is not None else (1 if a.quick else 3),
        budget_s=a.budget, only=[p.strip() for p in a.only.split(",") if p.strip()], profile=a.profile,
        encode_images=a.images or (8 if a.quick else 24), depth=a.depth, extras=not a.no_extras,
        command=" ".join([PROG, *(x for x in argv if x != "--no-doc")]), missing=a.missing, repeat=max(a.repeat, 1))


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and rewrite the ledger and the GPU section of the doc (unless ``--no-doc``); one line and 0 without
    a GPU; ``--merge``: only the ledger and the doc."""
    from .common import DOC, PACK_ROOT

    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    doc = None if a.no_doc or a.cpu_standin else (a.doc or DOC)
    ledger_path = a.ledger or (a.doc or DOC).parent / LEDGER_NAME
    if a.merge is not None:
        try:
            ledger = merge_results(a.merge, ledger_path, doc, a.run_date, a.run_commit)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"{PROG}: --merge {a.merge}: {exc}", file=sys.stderr)
            return 2
        print(f"{PROG}: {ledger_path} holds {len(ledger.runs)} run(s): "
              + ", ".join(f"R{r.number} {r.date} {r.device.name}" for r in ledger.runs)
              + (f"; {doc} rewritten" if doc is not None else ""))
        return 0
    if a.render:
        try:
            ledger = render_doc(ledger_path, a.doc or DOC)
        except (OSError, ValueError) as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 2
        print(f"{PROG}: {a.doc or DOC}'s GPU section rendered from {ledger_path} ({len(ledger.runs)} run(s))")
        return 0
    import torch

    if not a.cpu_standin and not torch.cuda.is_available():
        print(f"{PROG}: no CUDA GPU visible here (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda or 'none'}): nothing measured, docs/BENCHMARKS.md unchanged")
        return 0
    opts = dataclasses.replace(options_from(a, argv), commit=checkout_commit(PACK_ROOT))
    if a.cpu_standin:  # its figures never reach the doc, nor the ledger unless --ledger names one
        ledger_path = a.ledger
        opts = dataclasses.replace(opts, steps=a.steps or 3, warmup=a.warmup if a.warmup is not None else 1,
                                   encode_images=a.images or 2, extras=False, settings=STANDIN_SETTINGS,
                                   batches=STANDIN_BATCHES)
    try:
        base = load_ledger(ledger_path)
    except (OSError, ValueError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    out = a.out or PACK_ROOT / "out" / ("bench-gpu-cpu" if a.cpu_standin else "bench-gpu")
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "log.txt").open("w", encoding="utf-8")
    t0 = time.perf_counter()

    def say(line: str) -> None:
        text = f"[bench-gpu {time.perf_counter() - t0:6.1f}s] {line}"
        print(text, flush=True)
        log.write(text + "\n")
        log.flush()

    own = a.dir is None
    work = Path(tempfile.mkdtemp(prefix="streamcache-bench-gpu-")) if own else a.dir
    work.mkdir(parents=True, exist_ok=True)
    try:
        ctx, device, families, vaes = _setup(work, out, say, a.cpu_standin)
        ctx.doc, ctx.base = doc, base
        ctx.ledger = None if a.no_doc else ledger_path
        say(f"device: {device.name}, {device.memory_gib:.1f} GiB; torch {device.torch}; ComfyUI {device.comfyui}; "
            f"code {opts.commit}")
        measure(ctx, opts, families, vaes, device, torch.float32 if a.cpu_standin else torch.bfloat16)
    finally:
        log.close()
        if own:
            shutil.rmtree(work, ignore_errors=True)
    sys.stdout.write((out / "section.md").read_text())  # the doc's section was rewritten with the last figure
    return 0


def _setup(work: Path, out: Path, say: Callable[[str], None], cpu: bool
           ) -> tuple[Context, Device, dict[str, FamilySpec], dict[str, VaeSpec]]:
    """ComfyUI in-process (on the GPU, or the CPU for the stand-in), its folders in ``work``, the pack imported."""
    from support.pack import import_pack

    from .comfyui import comfy_setup, comfy_version

    install = comfy_setup(work, cpu=cpu)
    import folder_paths

    folder_paths.models_dir = str(work / "models")
    (work / "models" / "streamcache").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ctx = context_from_pack(import_pack(), work, out, say)
    device = device_info(ctx.device, comfy_version(install.path))
    if cpu:
        families, vaes = tiny_specs()
    else:
        families, vaes = dict(FULL_FAMILIES), dict(FULL_VAES)
    return ctx, device, families, vaes
