"""What ``scripts/bench-gpu`` runs and in which order: the arms, the groups they are measured and merged in, and
which groups ``--only`` / ``--missing`` select.

Plain data (no torch, no ComfyUI), so the unit tests check the plan and the selection. What fits the time is
:mod:`bench.gpu_budget`'s job.

Order: the four required families (SD1.5, SDXL, Flux-dev, WAN 2.1 1.3B), each at batch 1 and its batch ≥ 2, three
arms side by side (bound, ours, built-in); then Encode Dataset per VAE; then the memory-capped arms of #25, ours'
``checkpoint_mode`` forms, ours with the step's options (gradient clipping, the weights' average, Min-SNR) and without,
and the multi-GPU arms of #26 (present, skipped with one line where this checkout's trainer lacks the setting or the
machine has one GPU); then Qwen-Image and Lumina 2.

A **group** is what must come from one run, side by side: a family/batch row's three arms (``sd15/b1``), a capped
family's capped and uncapped arms (``cap/flux``), a family's checkpointing arms (``ckpt/sdxl``: exact, fast, kept), a
family's option arms (``options/sd15``: plain, clip, ema, snr, all, layers, prodigy, adafactor, lion, adamw8bit,
lion8bit, dropout), one
multi-GPU family
(``devices/sdxl``), one encode row (``encode/flux``), one profile (its own id). Runs accumulate by group
(:mod:`bench.gpu_ledger`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["ArmPlan", "GroupPlan", "BATCHES", "REQUIRED", "EXTRA", "CAPS", "CKPT_ARMS", "CKPT_MODES", "STEP_OPTIONS",
           "STEP_OPTION_ARMS", "OPTIMIZER_ARM_FAMILIES", "LAYER_CHOICES", "plan_family", "plan_caps", "plan_ckpt_modes",
           "plan_step_options", "plan_devices", "plan_groups", "select", "matches", "choose_depth", "group_key",
           "expected_ids", "rounds"]

REQUIRED = ("sd15", "sdxl", "flux", "wan21")
EXTRA = ("lumina2", "qwen_image")
BATCHES: dict[str, tuple[int, ...]] = {"sd15": (1, 8), "sdxl": (1, 4), "flux": (1, 2), "wan21": (1,),
                                       "lumina2": (1, 2), "qwen_image": (1,)}
"""Batch 1 and the batch ≥ 2 of each family (gpu-notes: SD1.5 512² b8, SDXL 1024² b4, Flux 1024² b1/b2, WAN 33 frames
480×832 b1)."""
ARMS = ("bound", "ours", "builtin")
DEPTH1_PEAK_GIB: dict[tuple[str, int], float] = {
    ("sd15", 1): 8.0, ("sd15", 8): 79.6, ("sdxl", 1): 22.5, ("sdxl", 4): float("inf"), ("wan21", 1): 54.5}
"""Largest peak of the three arms at ``checkpoint_depth`` 1 on the H200 runs (built-in included; inf: out of memory on
141 GB); a family/batch not listed is taken not to fit (Flux, Lumina 2, Qwen-Image)."""
CAPS: tuple[tuple[str, int, float | None], ...] = (
    ("sdxl", 1, None), ("sdxl", 1, 8.0), ("flux", 1, None), ("flux", 1, 24.0), ("flux", 1, 12.0),
    ("flux_fp8", 1, None), ("flux_fp8", 1, 12.0), ("wan21", 1, None), ("wan21", 1, 12.0))
"""#25's targets: (family, batch, device cap in GB; None = the uncapped reference), memory plan ``auto``;
``flux_fp8`` is Flux-dev with its weights stored in fp8 e4m3fn."""
CKPT_MODES: tuple[tuple[str, int], ...] = (("sd15", 1), ("sdxl", 1), ("flux", 1), ("wan21", 1), ("sdxl", 4))
"""How ours checkpoints, at batch 1 where a step is host-bound: every block checkpointed (``memory`` no offload)
``exact`` (the reference) and ``fast`` (the reentrant form's fewer ops and Python calls), and ``kept`` (``memory``
auto + keep blocks whole: at batch 1 the plan ``auto`` picks, blocks kept whole, not recomputed, in half the spare
memory; exact checkpoints for the rest). SDXL at batch 4 (``ckpt/sdxl_b4``, exact and kept only): what ``auto +
keep blocks whole`` buys, and costs, where ``auto`` checkpoints every block."""
CKPT_ARMS: dict[str, dict[str, str]] = {
    "exact": {"checkpoint_mode": "exact", "memory": "no offload"},
    "fast": {"checkpoint_mode": "fast", "memory": "no offload"},
    "kept": {"checkpoint_mode": "exact", "memory": "auto + keep blocks whole"}}
CKPT_ARMS_ABOVE_B1 = ("exact", "kept")
"""The arms of a :data:`CKPT_MODES` entry above batch 1 (``fast`` is a batch-1 question: the host's ops)."""
STEP_OPTIONS = ("sd15", "sdxl", "flux")
"""The families whose step the options are measured on, at batch 1: where a step is shortest, so what the options add
per step weighs most (SD1.5's 3,265 adapter tensors at rank 16 are the most per second of step)."""
STEP_OPTION_ARMS: dict[str, dict[str, float | str]] = {
    "plain": {},
    "clip": {"max_grad_norm": 1.0},
    "ema": {"ema_decay": 0.999},
    "snr": {"min_snr_gamma": 5.0},
    "all": {"max_grad_norm": 1.0, "ema_decay": 0.999, "min_snr_gamma": 5.0},
    "layers": {"train_layers": ""},
    "prodigy": {"optimizer": "Prodigy", "learning_rate": 1.0},
    "adafactor": {"optimizer": "Adafactor"},
    "lion": {"optimizer": "Lion", "learning_rate": 1e-4},
    "adamw8bit": {"optimizer": "AdamW8bit"},
    "lion8bit": {"optimizer": "Lion8bit", "learning_rate": 1e-4},
    "dropout": {"rank_dropout": 0.1, "module_dropout": 0.1}}
"""Ours without the step's options (``plain``, the reference), with each alone, with all three, with adapters on
part of the layers only (``layers``: the family's :data:`LAYER_CHOICES` piece) and with the Prodigy optimizer: what
gradient clipping (the norm is measured every step anyway), the weights' average and Min-SNR weighting cost on the
device (``bench/bench_step_extras.py`` counts their ops on the CPU), what training the attention alone saves, and
what Prodigy's step costs against AdamW's (``bench/bench_prodigy.py`` counts its ops and reads on the CPU), what
Adafactor's, Lion's and the 8-bit optimizers' do (``bench/bench_adafactor.py``, ``bench/bench_lion.py``,
``bench/bench_adamw8bit.py``), and what kohya's rank and module dropout add (``scripts/bench-comfy dropout`` counts
their ops). Lion's arms step at 1e-4, a Lion rate (the step's time does not depend on it)."""
OPTIMIZER_ARM_FAMILIES = {"lion": ("sd15", "sdxl"), "adamw8bit": ("sd15", "sdxl"), "lion8bit": ("sd15", "sdxl")}
"""The option arms measured on some families only: what an optimizer's step costs depends on the LoRA's tensors,
not on the model, and three more arms would take Flux's group past one device call (~680 s on an H100)."""
LAYER_CHOICES = {"sd15": "attn", "sdxl": "attn", "flux": "double_blocks"}
"""``train_layers`` of each family's ``layers`` arm (``bench/train_layers.py`` counts what each trains)."""


@dataclass(frozen=True)
class ArmPlan:
    """One arm to run: its id (``family/bB/arm``, ``cap/family-12/ours``, ``devices/family-N/ours``) and settings.

    ``rep``: which repetition (``--repeat``); ``est_step_s`` and ``setup_s``: what :mod:`bench.gpu_budget` expects
    of it on an H200 (a step; the model load and first step's extra, the arm's own set-up)."""

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
    setup_s: float = 0.0
    rep: int = 0


@dataclass(frozen=True)
class GroupPlan:
    """One group (see the module's docstring) in run order: its key, its section (``main``, ``encode``, ``cap``,
    ``devices``, ``extra``), the model it needs (a family, ``flux_fp8`` for a capped fp8 arm; an encode row: its
    VAE), its arms in the order they run (repetitions included; an encode row has none), the text encoders an
    encode row needs, and the family's parameters in billions (what building its model costs)."""

    key: str
    section: str
    family: str
    arms: tuple[ArmPlan, ...] = ()
    text: str = ""
    params_b: float = 0.0


def group_key(fig_id: str) -> str:
    """The group a figure belongs to: ``sd15/b1/ours`` → ``sd15/b1``; ``cap/flux_fp8-12/ours`` → ``cap/flux_fp8``;
    ``devices/sdxl-4/ours`` → ``devices/sdxl``; an encode row or a profile is its own group."""
    parts = fig_id.split("/")
    if parts[0] in ("encode", "profile"):
        return fig_id
    if parts[0] in ("cap", "devices", "ckpt", "options") and len(parts) >= 2:
        return f"{parts[0]}/{parts[1].rsplit('-', 1)[0]}"
    if len(parts) == 3:
        return f"{parts[0]}/{parts[1]}"
    return fig_id


def expected_ids(key: str) -> set[str] | None:
    """The arm ids a complete training group holds (``None``: a group of one figure, any: encode, devices, profile)."""
    head, _, rest = key.partition("/")
    planned = {"cap": plan_caps, "ckpt": plan_ckpt_modes, "options": plan_step_options}.get(head)
    if planned is not None:
        return {a.id for a in planned() if a.family == rest}
    if head in ("encode", "devices", "profile") or key.count("/") != 1:
        return None
    return {f"{key}/{arm}" for arm in ARMS}


def choose_depth(family: str, batch: int, device_gib: float, forced: int | None = None) -> tuple[int, str]:
    """``checkpoint_depth`` for all three arms of a family/batch, and why: 1 (ComfyUI's default) where the depth-1
    peak measured so far fits 90% of this device, else 2 (per block; ComfyUI counts the model itself as depth 1)."""
    if forced is not None:
        return forced, "set by --depth"
    peak = DEPTH1_PEAK_GIB.get((family, batch), float("inf"))
    if peak < 0.9 * device_gib:
        return 1, ""
    known = f"{peak:.1f} GiB on the first run" if peak != float("inf") else "out of memory on the first run"
    return 2, f"depth 1 would not fit ({known})"


def rounds(arms: list[ArmPlan], repeat: int) -> list[ArmPlan]:
    """``arms`` run ``repeat`` times, each round starting one arm later (bound, ours, built-in, then ours, built-in,
    bound, …): every arm runs ``repeat`` times and no arm always follows the same one (the device's warmth, the
    page cache and the allocator's state left by the previous arm then spread over all three)."""
    out = []
    for rep in range(max(repeat, 1)):
        turn = rep % len(arms)
        out += [replace(a, rep=rep) for a in arms[turn:] + arms[:turn]]
    return out


def plan_family(family: str, device_gib: float, batches: tuple[int, ...] | None = None,
                depth: int | None = None, params_b: float = 0.0, repeat: int = 1) -> list[ArmPlan]:
    """The three arms of ``family`` at each batch: bound, ours, built-in (side by side, same depth); every row
    ``repeat`` times (:func:`rounds`)."""
    from .gpu_budget import arm_setup_s, est_step_s

    arms = []
    group = "main" if family in REQUIRED else "extra"
    for batch in batches or BATCHES[family]:
        d, note = choose_depth(family, batch, device_gib, depth)
        row = [ArmPlan(f"{family}/b{batch}/{arm}", family, batch, arm, d, note,
                       est_step_s=est_step_s(family, batch, arm), group=group,
                       setup_s=arm_setup_s(family, arm, params_b)) for arm in ARMS]
        arms += rounds(row, repeat)
    return arms


def plan_caps(params_b: Mapping[str, float] | None = None) -> list[ArmPlan]:
    """#25's memory-capped arms: ours with the memory plan ``auto`` under each cap (and uncapped, the reference)."""
    from .gpu_budget import arm_setup_s, cap_step_s

    params_b = params_b or {}
    arms = []
    for family, batch, cap in CAPS:
        tag = f"{cap:g}" if cap is not None else "none"
        params = params_b.get(family.removesuffix("_fp8"), 0.0) * (0.5 if family.endswith("_fp8") else 1.0)
        arms.append(ArmPlan(f"cap/{family}-{tag}/ours", family, batch, "ours", 1, "the memory plan decides",
                            extra={"memory": "auto"}, cap_gib=cap, est_step_s=cap_step_s(family, batch, cap, params),
                            group="cap", setup_s=arm_setup_s(family, "ours", params)))
    return arms


def plan_ckpt_modes(params_b: Mapping[str, float] | None = None) -> list[ArmPlan]:
    """Ours' :data:`CKPT_ARMS` (exact the reference) per family of :data:`CKPT_MODES`."""
    from .gpu_budget import arm_setup_s, est_step_s

    params_b = params_b or {}
    return [ArmPlan(f"ckpt/{family}{'' if batch == 1 else f'_b{batch}'}-{mode}/ours", family, batch, "ours", 1,
                    "the memory plan decides" if mode == "kept" else "ours checkpoints every block",
                    extra=dict(extra), est_step_s=est_step_s(family, batch, "ours"), group="ckpt",
                    setup_s=arm_setup_s(family, "ours", params_b.get(family, 0.0)))
            for family, batch in CKPT_MODES for mode, extra in CKPT_ARMS.items()
            if batch == 1 or mode in CKPT_ARMS_ABOVE_B1]


def plan_step_options(params_b: Mapping[str, float] | None = None) -> list[ArmPlan]:
    """Ours with each of :data:`STEP_OPTION_ARMS` (``plain`` the reference) per family of :data:`STEP_OPTIONS` (the
    arms of :data:`OPTIMIZER_ARM_FAMILIES` on their families only), at batch 1 and the default memory plan."""
    from .gpu_budget import arm_setup_s, est_step_s

    params_b = params_b or {}
    return [ArmPlan(f"options/{family}-{mode}/ours", family, 1, "ours", 1, "the memory plan decides",
                    extra={"train_layers": LAYER_CHOICES[family]} if mode == "layers" else dict(extra),
                    est_step_s=est_step_s(family, 1, "ours"), group="options",
                    setup_s=arm_setup_s(family, "ours", params_b.get(family, 0.0)))
            for family in STEP_OPTIONS for mode, extra in STEP_OPTION_ARMS.items()
            if family in OPTIMIZER_ARM_FAMILIES.get(mode, STEP_OPTIONS)]


def plan_devices(count: int, params_b: Mapping[str, float] | None = None) -> list[ArmPlan]:
    """#26's scaling arms: ours on every GPU (``devices`` auto) at each required family's batch ≥ 2."""
    from .gpu_budget import arm_setup_s, est_step_s

    params_b = params_b or {}
    arms = []
    for family in REQUIRED:
        batch = BATCHES[family][-1]
        arms.append(ArmPlan(f"devices/{family}-{count}/ours", family, batch, "ours", 2, "",
                            extra={"devices": "auto"}, est_step_s=est_step_s(family, batch, "ours"),
                            group="devices", setup_s=arm_setup_s(family, "ours", params_b.get(family, 0.0))))
    return arms


def _grouped(section: str, arms: list[ArmPlan], params_b: Mapping[str, float]) -> list[GroupPlan]:
    keys = list(dict.fromkeys(group_key(a.id) for a in arms))
    out = []
    for key in keys:
        members = tuple(a for a in arms if group_key(a.id) == key)
        family = members[0].family
        out.append(GroupPlan(key, section, family, members, params_b=params_b.get(family.removesuffix("_fp8"), 0.0)))
    return out


def _repeated(groups: list[GroupPlan], repeat: int) -> list[GroupPlan]:
    """Each group's arms ``repeat`` times in rotating order (:func:`rounds`), as a family's rows are."""
    return [replace(g, arms=tuple(rounds(list(g.arms), repeat))) for g in groups]


def plan_groups(params_b: Mapping[str, float], vaes: Mapping[str, str], device_gib: float, gpus: int = 1, *,
                batches: Mapping[str, tuple[int, ...]] | None = None, depth: int | None = None, repeat: int = 1,
                extras: bool = True) -> list[GroupPlan]:
    """Every group of a whole run, in run order. ``params_b``: the families there are (name → parameters in
    billions); ``vaes``: the encode rows (VAE name → the text encoders it uses); ``gpus``: the devices (#26's
    arms name their count); ``repeat``: every training group's arms that many times in turn (encode rows once)."""
    batches = batches or {}
    out: list[GroupPlan] = []
    for family in (f for f in REQUIRED if f in params_b):
        out += _grouped("main", plan_family(family, device_gib, batches.get(family), depth, params_b[family], repeat),
                        params_b)
    out += [GroupPlan(f"encode/{name}", "encode", name, text=text) for name, text in vaes.items()]
    present = [a for a in plan_caps(params_b) if a.family.removesuffix("_fp8") in params_b]
    out += _repeated(_grouped("cap", present, params_b), repeat)
    out += _repeated(_grouped("ckpt", [a for a in plan_ckpt_modes(params_b) if a.family in params_b], params_b),
                     repeat)
    out += _repeated(_grouped("options", [a for a in plan_step_options(params_b) if a.family in params_b],
                              params_b),
                     repeat)
    out += _repeated(_grouped("devices", [a for a in plan_devices(gpus, params_b) if a.family in params_b],
                              params_b), repeat)
    if extras:
        for family in (f for f in EXTRA if f in params_b):
            out += _grouped("extra", plan_family(family, device_gib, batches.get(family), depth, params_b[family],
                                                 repeat), params_b)
    return out


def select(groups: list[GroupPlan], only: list[str], keys: set[str] | None = None) -> list[GroupPlan]:
    """The groups and arms ``--only`` patterns select (an encode row by its key), of those in ``keys`` when given
    (``--missing``); a group left without arms is dropped."""
    out = []
    for g in groups:
        if keys is not None and g.key not in keys:
            continue
        if g.section == "encode":
            if matches(g.key, only):
                out.append(g)
            continue
        arms = tuple(a for a in g.arms if matches(a.id, only))
        if arms:
            out.append(replace(g, arms=arms))
    return out


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
