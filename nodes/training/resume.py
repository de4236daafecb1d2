"""Continuing an existing LoRA exactly: its training state (optimizer state, step count, sampler position) is
saved at the end of every run and restored when the LoRA is continued.

The state lives in ``<ComfyUI output>/streamcache_train_state/<digest>.safetensors``, named by the content digest
of the LoRA's tensors (:func:`~dataset_cache.optimizer_state.lora_digest`): "Save LoRA Weights" names the LoRA
file itself, with a counter this node cannot know, and the digest finds the state again wherever the file is
copied (``output/loras`` to ``models/loras``) or however it is renamed. The format and its checks are the
library's (:mod:`dataset_cache.optimizer_state`); docs/ARCHITECTURE.md has the design.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import folder_paths

from ...dataset_cache.lr_schedule import LrSchedule
from ...dataset_cache.optimizer_args import parse_optimizer_args
from ...dataset_cache.optimizer_state import (
    AVERAGE_SLOTS,
    OPTIMIZER_SLOTS,
    TrainState,
    TrainStateError,
    capture_optimizer,
    check_average_fits,
    check_fits,
    lora_digest,
    optimizer_state_dict,
    read_train_state,
)
from ...dataset_cache.sampler import BatchPlan, BucketSampler
from ...dataset_cache.train_state_store import TrainStateStore
from .optimizers import group_state, slots_differ

__all__ = ["STATE_FOLDER", "Start", "capture_state", "resume_run", "save_state", "state_store"]

log = logging.getLogger("streamcache.train")

STATE_FOLDER = "streamcache_train_state"
"""The folder of training states in ComfyUI's output directory (beside ``loras/``, where Save LoRA writes)."""

_STATEFUL = ("AdamW", "Adam", "RMSprop", "Prodigy", "Lion", "Adafactor", "AdamW8bit", "Lion8bit")
"""Optimizers whose state a continued run loses without the state file (ComfyUI's SGD has no momentum, unless its
``optimizer_args`` give it one)."""


def state_store() -> TrainStateStore:
    """The training-state folder of this ComfyUI."""
    return TrainStateStore(Path(folder_paths.get_output_directory()) / STATE_FOLDER)


@dataclass
class Start:
    """Where a run starts.

    Attributes:
        steps: optimizer steps the existing LoRA already had (0 for a new one).
        first_batch: the global number of the run's first batch (its noise and timesteps).
        notes: what the user must know (NOTE lines: something is not as an uninterrupted run would be).
        info: what was restored, for the summary.
        average: with ``ema_decay``, the saved run's fp32 average of the weights to continue (``None``: the
            average starts at the weights the run starts from).
    """

    steps: int = 0
    first_batch: int = 0
    notes: list[str] = field(default_factory=list)
    info: list[str] = field(default_factory=list)
    average: dict[str, torch.Tensor] | None = None


def resume_run(run: Any, sampler: BucketSampler, existing: Mapping[str, torch.Tensor], name_steps: int | None
               ) -> Start:
    """Restore the existing LoRA's training state into ``run`` (its optimizer and scaler) and ``sampler`` (its
    position), or continue from the step count in the LoRA's name without one; say which.

    Args:
        run: the loaded run (``run.optimizer``, ``run.scaler``, ``run.lora_sd``, ``run.settings``).
        sampler: the run's sampler, at epoch 0.
        existing: the existing LoRA's tensors (empty: a new LoRA).
        name_steps: the step count in the LoRA's file name, ``None`` when the name has none.
    """
    settings = run.settings
    name = settings.existing_lora
    if name == "[None]":
        return Start()
    store = state_store()
    digest = lora_digest(existing)
    path = store.find(digest)
    problem = None
    state = None
    if path is not None:
        try:
            state = read_train_state(path, digest=digest, max_bytes=_max_state_bytes(run.lora_sd))
        except TrainStateError as exc:
            problem = f"its training state {path.name} cannot be used ({exc.reason})"
            log.warning("Train LoRA: existing_lora %r: %s", name, problem)
    if state is None:
        return _without_state(name, name_steps, sampler, settings, problem)
    assert path is not None  # the state was read from it
    store.touch(path)
    start = Start(state.steps, state.batches)
    restored = _restore_optimizer(run, state, start)
    _restore_average(run, state, start)
    try:
        if state.sampler is None:
            raise ValueError("the state holds no sampler position")
        sampler.load_state_dict(dict(state.sampler))
        where = "the batch order where it stopped"
    except ValueError as exc:
        _seek(sampler, state.batches)
        start.notes.append(f"existing_lora {name!r}: the batch order continues at batch {state.batches} by count, "
                           f"not from the saved position ({exc})")
        where = "the batch order by count"
    schedule_note = _schedule_note(name, state, settings)
    if schedule_note:
        start.notes.append(schedule_note)
    optimizer = (f"{state.optimizer} state restored" if restored and state.slots else
                 f"{state.optimizer} had no state to restore" if restored else f"{settings.optimizer} fresh")
    start.info.append(f"continued {name!r} from its training state ({state.steps} steps): {optimizer}, {where}")
    return start


def _schedule_note(name: str, state: TrainState, settings: Any) -> str | None:
    """What the user must know when this run's learning rate does not go on as the saved run's would have: another
    schedule, or the same one stretched over another number of steps (``steps`` counts this run's steps, so
    continuing a cancelled 1000-step run at step 900 with ``steps`` 1000 decays over 1900)."""
    if state.lr_schedule is None:  # written before states recorded it: nothing to compare
        return None
    try:
        saved = LrSchedule.from_dict(state.lr_schedule)
    except ValueError as exc:  # a kind of a later version
        log.info("Train LoRA: existing_lora %r: its run's learning-rate schedule is not one this version knows (%s)",
                 name, exc)
        return None
    mine = settings.lr_schedule_after(state.steps)
    step = state.steps
    if saved == mine or (saved.rate(step), saved.rate(step + 1)) == (mine.rate(step), mine.rate(step + 1)):
        return None
    note = (f"existing_lora {name!r}: step {step + 1} trains at learning rate {mine.rate(step):.3g}, where the run "
            f"that saved it would have used {saved.rate(step):.3g} (it trained with {saved.describe()}; this run "
            f"has {mine.describe()}: the {step} steps it had + steps {settings.steps})")
    same_kind = (saved.kind, saved.learning_rate, saved.warmup_steps) == (mine.kind, mine.learning_rate,
                                                                          mine.warmup_steps)
    if same_kind and saved.total_steps > step:
        note += f"; to finish its schedule exactly, set steps to {saved.total_steps - step}"
    return note


def _restore_optimizer(run: Any, state: TrainState, start: Start) -> bool:
    """Load the saved optimizer (and gradient scaler) state into the run's; ``False`` (with a note) when it does not
    fit, and the optimizer then starts fresh."""
    settings = run.settings
    why = check_fits(state, settings.optimizer, run.lora_sd) or slots_differ(run.optimizer, state.slots.values())
    if why is None:
        try:
            run.optimizer.load_state_dict(optimizer_state_dict(state, list(run.lora_sd), run.optimizer.state_dict(),
                                                               group_state(settings.optimizer)))
            if run.scaler is not None and state.scaler:
                run.scaler.load_state_dict(dict(state.scaler))
            return True
        except (ValueError, RuntimeError, KeyError, TypeError) as exc:
            why = f"torch refused it: {exc}"
            run.optimizer.state.clear()  # nothing half-restored: a fresh optimizer
    start.notes.append(f"existing_lora {settings.existing_lora!r}: its saved optimizer state does not fit this run "
                       f"({why}); {settings.optimizer} starts fresh")
    return False


def _restore_average(run: Any, state: TrainState, start: Start) -> None:
    """A LoRA saved by a run that averaged its weights is their average: continue the weights that run trained
    (its state holds them), and with ``ema_decay`` its average too, so the continuation is the run that never
    stopped. Without ``ema_decay`` the trained weights go on unaveraged, and the node says so."""
    if not state.weights:
        return
    name = run.settings.existing_lora
    why = check_average_fits(state, run.lora_sd)
    if why is not None:
        start.notes.append(f"existing_lora {name!r}: it is the average of its weights, whose trained values cannot "
                           f"be restored ({why}): this run starts from the average")
        return
    with torch.no_grad():
        for key, param in run.lora_sd.items():
            param.copy_(state.weights[key])
    if run.settings.ema_decay > 0:
        start.average = dict(state.average)
    else:
        start.notes.append(f"existing_lora {name!r} is the moving average of its weights (ema_decay "
                           f"{state.ema_decay:g}): this run continues the weights it trained, without averaging; "
                           "set ema_decay to continue the average")


def _without_state(name: str, name_steps: int | None, sampler: BucketSampler, settings: Any, problem: str | None
                   ) -> Start:
    """Continue from the step count in the name (as before training states existed), and say what is lost."""
    steps = name_steps or 0
    start = Start(steps, steps * settings.grad_accumulation_steps)
    _seek(sampler, start.first_batch)
    why = problem or ("it has no saved training state (trained before Train LoRA saved one, by another trainer, "
                      "or its state was removed)")
    if name_steps is None:
        start.notes.append(
            f"existing_lora {name!r}: {why}, and its name carries no step count (Save LoRA Weights names files "
            "<prefix>_<steps>_steps_<counter>_): the batch order, noise and timesteps start again from step 0 and "
            f"{settings.optimizer} starts fresh")
    elif settings.optimizer in _STATEFUL or parse_optimizer_args(settings.optimizer_args).get("momentum") or problem:
        start.notes.append(
            f"existing_lora {name!r}: {why}: continuing at step {steps} from its name, but {settings.optimizer} "
            "starts fresh, so the result differs from one uninterrupted run")
    return start


def _seek(sampler: BucketSampler, batch: int) -> None:
    if batch and len(sampler):
        sampler.seek(batch // len(sampler), batch % len(sampler))


def _max_state_bytes(params: Mapping[str, torch.Tensor]) -> int:
    """The largest state file the run's parameters can have: every slot of every parameter in 8-byte numbers,
    plus its header (a name and an entry per slot) and the metadata."""
    slots = max(len(s) for s in OPTIMIZER_SLOTS.values()) + len(AVERAGE_SLOTS)
    return sum(p.numel() * 8 * slots + 1024 * slots for p in params.values()) + (1 << 20)


def capture_state(run: Any, sampler: BucketSampler, start: Start, *, done: int | None = None,
                  after: BatchPlan | None = None) -> TrainState:
    """The run's training state, on the CPU, after ``done`` of its steps (``None``: all of them, taken before
    ``finish`` releases the optimizer); its ``lora_digest`` is filled in by :func:`save_state` from the weights as
    saved.

    ``after`` is the plan of the last batch trained: the sampler's position is taken right after it, wherever the
    loader stands (a run stopped mid-step has been handed batches it never trained). ``None``: where the sampler is.
    """
    settings = run.settings
    done = settings.steps if done is None else done
    slots, groups = capture_optimizer(run.optimizer.state_dict(), list(run.lora_sd))
    scaler = run.scaler.state_dict() if run.scaler is not None else None
    average = run.average  # with ema_decay the LoRA saved is the average: the trained weights go in the state
    trained = {k: v.detach().to("cpu", copy=True) for k, v in run.lora_sd.items()} if average is not None else {}
    return TrainState("", settings.optimizer, start.steps + done,
                      start.first_batch + done * settings.grad_accumulation_steps, slots, groups,
                      _sampler_state(sampler, after), scaler or None,
                      settings.lr_schedule_after(start.steps).as_dict(),
                      settings.ema_decay if average is not None else None, trained,
                      average.state() if average is not None else {})


def _sampler_state(sampler: BucketSampler, after: BatchPlan | None) -> dict[str, Any]:
    if after is None:
        return sampler.state_dict()
    now = sampler.position
    sampler.seek(after.epoch, after.index + 1)
    try:
        return sampler.state_dict()
    finally:
        sampler.seek(*now)


def save_state(state: TrainState, lora: Mapping[str, torch.Tensor], digest: str | None = None
               ) -> tuple[list[str], list[str]]:
    """Write the state beside the LoRA (by the digest of ``lora``, unless given); return ``(notes, info)`` for the
    summary. A failed write never fails the run: it is said, and the LoRA continues later as one without a state."""
    store = state_store()
    digest = lora_digest(lora) if digest is None else digest
    try:
        path, pruned = store.save(dataclasses.replace(state, lora_digest=digest))
    except (OSError, ValueError) as exc:
        log.warning("Train LoRA: could not save the training state: %s", exc)
        return [f"the training state could not be saved ({exc}); continuing this LoRA will start "
                f"{state.optimizer} fresh"], []
    info = [f"training state saved as {store.folder.name}/{path.name} ({state.steps} steps, {state.optimizer}): "
            "continuing this LoRA resumes exactly"]
    if pruned:
        info.append(f"removed {len(pruned)} older training state(s) to keep that folder within "
                    f"{store.max_files} files ({', '.join(pruned[:3])}{' ...' if len(pruned) > 3 else ''})")
    return [], info
