"""Saves during a run: the LoRA trained so far (the latest save with its training state) every ``save_every`` steps
and when the run stops early (Cancel, an error), so a long run loses at most ``save_every`` steps, or none, and
continues exactly.

ComfyUI's own trainer returns its LoRA only when the last step is done: a run cancelled or failed at step 900 of
1000 leaves nothing, and kohya, OneTrainer and ai-toolkit all save as they go. A save writes what **Save LoRA
(Stream Cache)** writes (the adapter tensors with the run's training metadata, named
``<prefix>_<steps>_steps_<counter>_.safetensors`` in ComfyUI's output folder, so ``existing_lora`` reads the step
count from the name) and the training state :mod:`.resume` writes at a
run's end, found again by the LoRA's content: continuing a save is the same as never having stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

import comfy.model_management
import folder_paths

from ...dataset_cache.optimizer_state import TrainState, lora_digest
from ...dataset_cache.sampler import BatchPlan, BucketSampler
from .lora_output import write_lora
from .resume import Start, capture_state, save_state, state_store

__all__ = ["RunSaves", "lora_weights", "shown_path"]

log = logging.getLogger("streamcache.train")


def lora_weights(run: Any) -> dict[str, torch.Tensor]:
    """The run's adapter weights as they stand, as detached CPU tensors in the LoRA's dtype (``SaveLoRA``'s keys):
    with ``ema_decay``, their moving average (what the run outputs and saves)."""
    if run.average is not None:
        return {k: v.to(run.adapter_dtype) for k, v in run.average.weights().items()}
    return {k: v.detach().to("cpu", run.adapter_dtype).clone() for k, v in run.lora_sd.items()}


class RunSaves:
    """The step loop's ``save`` hook: writes the LoRA after a step and its training state beside it (the state of
    the run's previous save removed: continuing an earlier save starts its optimizer afresh, and says so).

    The training thread only copies the weights and the optimizer's state off the device (a snapshot); a thread of
    its own writes them (serializing, two files, their fsyncs: most of a save), one save at a time, while the next
    steps train. A save as the run stops is written at once, after the one being written.

    A periodic save that fails (a full disk, a folder that cannot be written) is said in the run's notes and the
    run goes on; a save as the run stops only logs its outcome, the run's own error follows.
    """

    def __init__(self, run: Any, sampler: BucketSampler, start: Start,
                 on_saved: Callable[[int, str], None] | None = None, metadata: Mapping[str, str] | None = None
                 ) -> None:
        self.run = run
        # the run's training keys (lora_output.describe_training), the steps it will end at known now
        self.metadata = {**metadata, "ss_max_train_steps": str(start.steps + run.settings.steps)} if metadata else {}
        self.on_saved = on_saved  # told each save's total steps and file (from the writer's thread, mostly)
        self.sampler = sampler
        self.start = start
        self.saved: list[tuple[int, Path]] = []
        self.waited: list[float] = []  # what each save held the training thread: its snapshot, a previous write
        self.written: list[float] = []  # each save's writing, on the writer's thread
        self.notes: list[str] = []
        self.state_steps: int | None = None  # the total steps of the last save whose training state was written
        self._state: Path | None = None  # the state this run created for its last save
        self._writer: threading.Thread | None = None

    def __call__(self, done: int, last: BatchPlan, stopped_by: BaseException | None = None) -> None:
        """Save after ``done`` steps of this run, ``last`` being the plan of their last batch; ``stopped_by``: what
        ends the run early (``None``: a periodic save, written on the writer's thread)."""
        steps = self.start.steps + done
        t0 = time.perf_counter()
        self.wait()
        try:
            state = capture_state(self.run, self.sampler, self.start, done=done, after=last)
            lora = lora_weights(self.run)
        except (OSError, ValueError) as exc:
            self._failed(steps, exc, stopped_by)
            return
        self.waited.append(time.perf_counter() - t0)
        if stopped_by is not None:
            self._write(steps, state, lora, stopped_by)
            return
        self._writer = threading.Thread(target=self._write, args=(steps, state, lora, None),
                                        name="streamcache-lora-save", daemon=True)
        self._writer.start()

    def wait(self) -> None:
        """Wait until the save being written is on disk (the next save and the run's end wait so)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def _write(self, steps: int, state: TrainState, lora: dict[str, torch.Tensor],
               stopped_by: BaseException | None) -> None:
        t0 = time.perf_counter()
        try:
            path = write_lora(lora, self.run.settings.save_prefix, steps, self.metadata)
            self._save_state(state, lora)
        except Exception as exc:  # on the writer's thread nothing else would see it: said, and the run goes on
            self._failed(steps, exc, stopped_by)
            return
        self.written.append(time.perf_counter() - t0)
        self.saved.append((steps, path))
        if self.on_saved is not None:
            try:
                self.on_saved(steps, shown_path(path))
            except Exception:  # showing a save must never fail it
                log.debug("could not show the save", exc_info=True)
        if stopped_by is None:
            log.info("Train LoRA: saved the LoRA at step %d as %s", steps, path)
            return
        log.warning("Train LoRA: the run stopped after step %d (%s); the LoRA trained so far is saved as %s. To "
                    "continue it, pick it as existing_lora (refresh the list: a file in output/loras is listed as "
                    "'loras/<name> [output]').", steps, _describe(stopped_by), path)

    def _save_state(self, state: TrainState, lora: dict[str, torch.Tensor]) -> None:
        """Write the save's training state, and remove the one this run wrote for its previous save: a run keeps
        one state of its saves (and its end's), not one per save, which would crowd other LoRAs' states out of the
        folder's 32. Only a state this run created is ever removed."""
        store = state_store()
        digest = lora_digest(lora)
        path = store.path_for(digest)
        existed = store.find(digest) is not None
        notes, _ = save_state(state, lora, digest)
        if notes:  # not written: said once, as a failed save
            if not any(n.startswith("the training state") for n in self.notes):
                self.notes.extend(notes)
            return
        if self._state is not None and self._state != path:
            store.remove(self._state)
        self._state = None if existed else path
        self.state_steps = state.steps

    def holds_the_end(self, steps: int) -> bool:
        """Whether the last save is the run's end (``steps`` in total) with its training state written: the run's
        own state would be the same file written again, so the run does not write it."""
        self.wait()
        return bool(self.saved) and self.saved[-1][0] == steps == self.state_steps

    def _failed(self, steps: int, exc: Exception, stopped_by: BaseException | None) -> None:
        log.warning("Train LoRA: could not save the LoRA at step %d: %s", steps, exc)
        if stopped_by is None and not self.notes:  # once: every later save would likely fail the same way
            self.notes.append(f"the LoRA could not be saved at step {steps} ({exc}); the run went on")

    def describe(self) -> list[str]:
        """The summary's line on the saves made (none: nothing)."""
        if not self.saved:
            return []
        steps = ", ".join(str(s) for s, _ in self.saved)
        last, where = self.saved[-1][0], shown_path(self.saved[-1][1])
        state = ", with its training state," if last == self.state_steps else ""
        return [f"saved the LoRA at step{'s' if len(self.saved) > 1 else ''} {steps} (training waited "
                f"{max(self.waited):.1f} s per save at most, writing took {max(self.written):.1f} s; the last{state} "
                f"as {where})"]


def _describe(error: BaseException) -> str:
    if isinstance(error, comfy.model_management.InterruptProcessingException):
        return "cancelled"
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")


def shown_path(path: Path) -> str:
    """``path`` relative to the output folder where it is inside it (the summary names where to look)."""
    try:
        return f"output/{path.relative_to(folder_paths.get_output_directory()).as_posix()}"
    except ValueError:
        return str(path)
