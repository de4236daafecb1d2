"""What a training run reports: per step (progress, the live loss curve) and at the end (the node's summary)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...dataset_cache.dataset import Sample
from ...dataset_cache.loader import Batch
from ...dataset_cache.dataset_mix import DatasetMix, shared_samples
from ...dataset_cache.grad_clip import CLIP_EPSILON
from ...dataset_cache.lr_schedule import LrSchedule

__all__ = ["RowCounts", "Startup", "describe_grad_norms", "describe_rates", "describe_startup", "StepReport",
           "TrainResult", "counted", "overlap_notes", "validation_overlap_notes"]

@dataclass(frozen=True)
class StepReport:
    """What one optimizer step did (passed to ``on_step`` on the execution thread).

    Attributes:
        step: optimizer steps done (1-based).
        total: optimizer steps of the run.
        loss: this step's loss (mean over its accumulated batches).
        loss_smooth: exponential moving average of ``loss``.
        samples_per_s: batch rows trained per second since the start.
        data_wait_pct: share of the time the step loop waited for the loader, in percent.
        epoch: the dataset epoch of the step's last batch.
        elapsed_s: seconds since the step loop started, at this report.
        waited_s: of those, the seconds the loop waited for the loader.
        learning_rate: the rate this step trained at (``lr_schedule``), ``None`` when the loop sets none.
        val_step: the step of the latest validation loss (``val_dataset``), ``None`` before any or without one.
        val_loss: that loss.
        grad_norm: the global L2 norm of this step's gradients before clipping (``max_grad_norm``), ``None`` for a
            step whose optimizer step did not run.
    """

    step: int
    total: int
    loss: float
    loss_smooth: float
    samples_per_s: float
    data_wait_pct: float
    epoch: int
    elapsed_s: float = 0.0
    waited_s: float = 0.0
    learning_rate: float | None = None
    val_step: int | None = None
    val_loss: float | None = None
    grad_norm: float | None = None


@dataclass
class RowCounts:
    """What the trained batch rows were: how many, and how many took each variant (caption dropout, a mirror, a
    loss mask, a regularization image, an edit model's reference image), so the summary shows that a setting did
    what it says.

    ``masks_ignored``: why the loss ignores masks in this run (``"masked_loss off"``, ``"unmasked_weight 1"``), or
    ``""`` when a row's mask weighs its loss; the summary then counts the rows with a mask as not masked.
    """

    trained: int = 0
    dropped: int = 0
    mirrored: int = 0
    masked: int = 0
    regularization: int = 0
    masks_ignored: str = ""
    referenced: int = 0

    def add(self, plan: Any, main_samples: int) -> None:
        """Count the rows of one batch plan (rows of samples from ``main_samples`` on are regularization rows)."""
        self.trained += len(plan.sample_indices)
        self.dropped += sum(plan.dropped)
        self.mirrored += sum(plan.mirrored)
        self.masked += sum(k is not None for k in plan.mask_keys)
        self.regularization += sum(i >= main_samples for i in plan.sample_indices)
        self.referenced += sum(k is not None for k in plan.reference_keys[:len(plan.sample_indices)])

    def describe(self) -> str:
        """``"rows: 48 trained, 5 with the empty caption, ..."``, or ``""`` when no row took a variant."""
        masked = "with a mask" if not self.masks_ignored else f"with a mask not applied ({self.masks_ignored})"
        parts = [(self.dropped, "with the empty caption"), (self.mirrored, "mirrored"), (self.masked, masked),
                 (self.regularization, "regularization"), (self.referenced, "with a reference image")]
        if not any(n for n, _ in parts):
            return ""
        return f"rows: {self.trained} trained, " + ", ".join(f"{n} {what}" for n, what in parts if n)

    @classmethod
    def for_settings(cls, masked_loss: bool, unmasked_weight: float) -> RowCounts:
        """Counts for a run with these loss settings (whether the rows' masks reach the loss)."""
        ignored = "masked_loss off" if not masked_loss else "unmasked_weight 1" if unmasked_weight == 1.0 else ""
        return cls(masks_ignored=ignored)


def overlap_notes(main: Sequence[Sample] | DatasetMix, reg: Sequence[Sample] | DatasetMix, reg_name: str
                  ) -> list[str]:
    """A warning when the regularization set holds images the dataset trains (the same Encode output connected to
    both inputs, or overlapping folders), naming both; training goes on (kohya does not check at all)."""
    shared = shared_samples(main, reg)
    if not shared:
        return []
    main_name = " + ".join(repr(n) for n, _ in main.parts) if isinstance(main, DatasetMix) else "the dataset"
    n_reg = len(reg.samples if isinstance(reg, DatasetMix) else reg)
    example = shared[0].source or shared[0].latent
    what = (f"is the same dataset as dataset {main_name} (all {n_reg} of its images)" if len(shared) == n_reg else
            f"shares {len(shared)} of its {n_reg} images with dataset {main_name} (e.g. {example})")
    return [f"{reg_name} {what}: those images train as both the subject and its regularization, which works "
            "against what regularization is for; connect images of the class, not of the subject"]


def validation_overlap_notes(main: Sequence[Sample] | DatasetMix, val: Sequence[Sample]) -> list[str]:
    """A warning when the validation set holds images the dataset trains: their loss says how well the LoRA fits what
    it trains on, not how it does on images it never saw; training goes on."""
    shared = shared_samples(main, val)
    if not shared:
        return []
    return [f"val_dataset shares {len(shared)} of its {len(val)} images with the dataset it trains (e.g. "
            f"{shared[0].source or shared[0].latent}): their validation loss measures images the LoRA trains on; "
            "hold the validation images out of the training folders"]


def counted(batches: Iterator[Batch], counts: RowCounts, main_samples: int) -> Iterator[Batch]:
    """``batches``, counting each one's rows into ``counts`` as it is handed to the step loop."""
    for batch in batches:
        counts.add(batch.plan, main_samples)
        yield batch


class Startup:
    """Where the time from Train LoRA's call to its first step went, phase by phase.

    A first step that takes long is the one wait a user sees before any progress; the phases say which part to
    look at (the memory probe of a large model, the model's load onto the device, a first batch read from a cold
    disk). Each :meth:`mark` closes the phase that ran since the one before.
    """

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """The phase ``phase`` ended now (a phase marked twice adds up)."""
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now

    def describe(self) -> str:
        return describe_startup(self.phases)


def describe_rates(schedule: LrSchedule, done: int, steps: int) -> tuple[str, ...]:
    """The learning rates a run of ``steps`` steps after ``done`` trained at, for the summary: ``()`` for one
    constant rate (the node's ``learning_rate``)."""
    if schedule.is_constant:
        return ()
    first, last = done, done + steps - 1
    return (f"learning rate {schedule.describe()}: {schedule.rate(first):.3g} at step {first + 1}, "
            f"{schedule.rate(last):.3g} at step {last + 1}",)


def describe_grad_norms(norms: Sequence[float], max_norm: float) -> str:
    """``"; gradient norm 0.41 median, 2.3 max, clipped to 1 in 7 of 400 steps"`` for the summary (``""`` for no
    step): how often clipping acted says whether ``max_grad_norm`` is a safety net (a few steps) or a second learning
    rate (most of them). Non-finite norms (fp16 steps the scaler skipped) are counted apart."""
    if not norms:
        return ""
    finite = [n for n in norms if math.isfinite(n)]
    text = f"; gradient norm {statistics.median(finite):.3g} median, {max(finite):.3g} max" if finite else (
        "; gradient norm")
    if max_norm > 0:
        clipped = sum(n + CLIP_EPSILON > max_norm for n in finite)
        text += f", clipped to {max_norm:g} in {clipped} of {len(norms)} steps"
    if len(finite) < len(norms):
        text += f", not finite in {len(norms) - len(finite)} steps (with fp16: steps the gradient scaler skipped)"
    return text


def describe_startup(phases: dict[str, float]) -> str:
    """``"first step after 4.0 s (data 0.0 s, model 1.2 s, ...)"``, or ``""`` before any phase ended."""
    if not phases:
        return ""
    parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items())
    return f"first step after {sum(phases.values()):.1f} s ({parts})"


@dataclass
class TrainResult:
    """The trained adapter weights and what the run measured.

    Attributes:
        lora: ComfyUI ``LORA_MODEL``: adapter parameter name → detached CPU tensor (``SaveLoRA``'s keys).
        losses: one loss per optimizer step.
        steps: total steps including those of ``existing_lora`` (what ``SaveLoRA`` names the file with).
        seconds: wall time of the step loop.
        samples_per_s: batch rows per second over the run.
        data_wait_pct: share of the loop's time spent waiting for data, in percent.
        buckets: latent shape ``(C, H, W)`` (``(C, T, H, W)`` for video latents) → occurrences per epoch.
        notes: settings the run had to change, for the user (a batch size clamped to the largest bucket).
        rows: the trained rows and how many took each variant.
        info: what was restored and saved for continuing the LoRA (its training state).
        memory_plan: the memory plan the run trained with and its estimate, as data
            (:meth:`dataset_cache.memory_plan.MemoryPlan.as_dict`, with what the weight streamer did).
        startup: seconds of each phase before the first step ended (:class:`Startup`), in order.
        validation: with ``val_dataset``, each measurement's ``(global step, validation loss)``.
        grad_norms: each step's gradient norm before clipping (:mod:`dataset_cache.grad_clip`).
        max_grad_norm: the norm the gradients were clipped to (0: not clipped).
        saves: with ``save_every``, each save's seconds: ``waited_s`` what it held the training thread (the copy off
            the device, a previous save still being written), ``written_s`` its writing, on the writer's thread.
        samples: with ``sample_count``, every sampling's images as latents in one batch (each sampling's rows in
            turn), on the CPU; ``None``: none taken.
    """

    lora: dict[str, torch.Tensor]
    losses: list[float]
    steps: int
    seconds: float
    samples_per_s: float
    data_wait_pct: float
    buckets: dict[Any, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    rows: RowCounts = field(default_factory=RowCounts)
    info: tuple[str, ...] = ()
    memory_plan: dict[str, Any] = field(default_factory=dict)
    startup: dict[str, float] = field(default_factory=dict)
    saves: dict[str, list[float]] = field(default_factory=dict)
    validation: list[tuple[int, float]] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    max_grad_norm: float = 0.0
    samples: torch.Tensor | None = None

    def summary(self) -> str:
        """One paragraph for the node's UI (what was changed from the settings first)."""
        first = sum(self.losses[:5]) / max(1, len(self.losses[:5]))
        last = sum(self.losses[-5:]) / max(1, len(self.losses[-5:]))
        rows = self.rows.describe()
        return "".join(f"NOTE: {n}. " for n in self.notes) + (
            f"trained {len(self.losses)} steps ({self.steps} in total) in {self.seconds:.1f} s: "
            f"{self.samples_per_s:.2f} samples/s, waited for data {self.data_wait_pct:.1f}% of the time; "
            f"loss {first:.4f} (first 5) → {last:.4f} (last 5)"
            + describe_grad_norms(self.grad_norms, self.max_grad_norm)
            + f"; buckets {', '.join(f'{list(b)}×{n}' for b, n in self.buckets.items())}"
            + (f"; {rows}" if rows else "") + "".join(f"; {i}" for i in self.info)
            + (f"; memory: {self.memory_plan['description']}" if self.memory_plan.get("description") else "")
            + (f"; {describe_startup(self.startup)}" if self.startup else "")
        )
