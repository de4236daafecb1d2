"""What the step loop keeps of each step's losses: read back from the device a step late (:class:`LaggedLosses`,
so the training thread never waits for the device just to learn a loss), checked finite (a NaN or infinite loss
stops the run, naming its batch's entries: :class:`NonFiniteLossError`), and tallied into the per-step report
(:class:`Tally`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

import comfy.utils

from ...dataset_cache.loader import Batch
from ...dataset_cache.trainable import non_finite_entries
from .report import StepReport

__all__ = ["SMOOTHING", "Done", "LaggedLosses", "NonFiniteLossError", "Tally", "finite_losses"]

SMOOTHING = 0.1
"""Weight of the newest loss in the exponential moving average reported as ``loss_smooth``."""


class NonFiniteLossError(ValueError):
    """Training stopped at a NaN or infinite loss: every later step would only spread it into the LoRA."""

    def __init__(self, step: int, loss: float, batch: Batch) -> None:
        plan = batch.plan
        bad = non_finite_entries(plan.latent_keys, batch.latents, plan.caption_keys, batch.conditioning)
        cause = (f"these entries hold NaN or infinite values: {', '.join(bad[:4])}"
                 f"{f' and {len(bad) - 4} more' if len(bad) > 4 else ''}; the cache's checksums cannot catch values "
                 "that were stored that way: re-encode those images and captions" if bad else
                 "the batch's values are finite, so the model diverged: lower the learning rate, or train in "
                 "bf16/fp32 rather than fp16")
        super().__init__(f"training stopped at step {step}: the loss is {loss} (batch {plan.index} of epoch "
                         f"{plan.epoch}, latents {', '.join(plan.latent_keys[:4])}"
                         f"{' ...' if len(plan.latent_keys) > 4 else ''}); {cause}. No LoRA was written from this "
                         "step on")
        self.step = step
        self.entries = bad


def finite_losses(step: int, losses: Sequence[torch.Tensor | float], batches: Sequence[Batch]) -> list[float]:
    """The losses of step ``step`` (0-based) as floats; a non-finite one raises, naming its batch."""
    values = [float(v) for v in losses]
    for value, batch in zip(values, batches):
        if not math.isfinite(value):
            raise NonFiniteLossError(step + 1, value, batch)
    return values


class Done(NamedTuple):
    """A step's values read back from the device: its losses (one per accumulated batch), its batches, and the
    global norm of its gradients before clipping (``None`` for a step cut short before its optimizer step)."""

    step: int
    losses: list[float]
    batches: list[Batch]
    grad_norm: float | None


class LaggedLosses:
    """Each step's losses and gradient norm copied from the device as the step's last work, read when the next step
    has been queued: the training thread then never waits for the device to drain its queue just to learn a loss
    (on CUDA the copy goes into pinned memory after the step's work, and an event says when it arrived). Two pinned
    buffers, made at the first step and used in turn (allocating pinned memory is slow and may synchronize)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._held: tuple[int, torch.Tensor, Any, list[Batch], bool] | None = None
        self._host: list[torch.Tensor] = []
        self._turn = 0

    def swap(self, step: int | None, losses: list[torch.Tensor], batches: list[Batch],
             grad_norm: torch.Tensor | None = None) -> Done | None:
        """Hold step ``step``'s losses and gradient norm (``step`` ``None``: none, the run ended) and return the
        step held before, read."""
        held, self._held = self._held, None
        if step is not None and losses:
            values = torch.stack([v.detach().reshape(()).float().to(losses[0].device)
                                  for v in [*losses, *([grad_norm] if grad_norm is not None else [])]])
            event = None
            if self.cuda and values.is_cuda:
                if not self._host or self._host[0].shape != values.shape:
                    self._host = [torch.empty(values.shape, dtype=values.dtype, pin_memory=True) for _ in range(2)]
                host = self._host[self._turn]  # the other one holds the step being read below
                self._turn ^= 1
                host.copy_(values, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                values = host
            self._held = (step, values, event, batches, grad_norm is not None)
        if held is None:
            return None
        done_step, done_values, done_event, done_batches, has_norm = held
        if done_event is not None:
            done_event.synchronize()
        read = done_values.tolist()
        return Done(done_step, read[:-1] if has_norm else read, done_batches, read[-1] if has_norm else None)


class Tally:
    """The run's losses, their moving average, rows and waits, and the per-step report (progress bar, callback)."""

    def __init__(self, steps: int, on_step: Callable[[StepReport], None] | None,
                 rate: Callable[[int], float] | None = None, validation: Any = None) -> None:
        self.steps = steps
        self.on_step = on_step
        self.rate = rate  # the learning rate of a step of the run (its number from 0), for the report
        self.validation = validation  # its latest (step, loss), for the report
        self.pbar = comfy.utils.ProgressBar(steps)
        self.losses: list[float] = []
        self.grad_norms: list[float] = []  # one per step whose optimizer step ran, before clipping
        self.smooth: float | None = None
        self.rows = 0
        self.wait = 0.0
        self.t0 = time.perf_counter()

    def add(self, step: int, loss: float, batch: Batch, grad_norm: float | None = None) -> None:
        self.losses.append(loss)
        if grad_norm is not None:
            self.grad_norms.append(grad_norm)
        self.smooth = loss if self.smooth is None else (1 - SMOOTHING) * self.smooth + SMOOTHING * loss
        self.pbar.update(1)  # ComfyUI's progress hook also checks the interrupt flag
        if self.on_step is not None:
            elapsed = time.perf_counter() - self.t0
            val_step, val_loss = (self.validation.latest if self.validation is not None else None) or (None, None)
            self.on_step(StepReport(step + 1, self.steps, loss, self.smooth, self.rows / elapsed if elapsed else 0.0,
                                    100.0 * self.wait / elapsed if elapsed else 0.0, batch.plan.epoch,
                                    elapsed, self.wait, self.rate(step) if self.rate is not None else None,
                                    val_step, val_loss, grad_norm))
