"""The learning rate of each optimizer step: a warm-up, then constant, cosine or linear decay.

A schedule is a pure function of the step's number counted over the whole training (steps an earlier run of the same
LoRA already trained included), so a run continued from a saved state sets exactly the learning rates the run that
never stopped would have set: nothing of the schedule has to be saved to continue it. docs/ARCHITECTURE.md ("The
learning-rate schedule") has the design.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LR_SCHEDULES", "LrSchedule"]

LR_SCHEDULES = ("constant", "cosine", "linear")
"""The decays after the warm-up: none; half a cosine from the full rate to 0; a straight line from it to 0."""

_MAX_STEPS = 1 << 40


@dataclass(frozen=True)
class LrSchedule:
    """The learning rate of every step of a training of ``total_steps`` optimizer steps.

    The first ``warmup_steps`` steps rise in a straight line: step ``i`` (from 0) takes ``(i + 1) / warmup_steps`` of
    ``learning_rate``, so the first step already trains and the warm-up's last takes the full rate. The steps after it
    decay over what is left: with ``p = (i - warmup_steps) / (total_steps - warmup_steps)`` (0 at the first, under 1
    at the last), cosine takes ``(1 + cos(pi p)) / 2``, linear ``1 - p``. No step is given a rate of 0: a step that
    would not train is a step wasted.

    Attributes:
        kind: one of :data:`LR_SCHEDULES`.
        learning_rate: the full rate (the node's ``learning_rate``).
        warmup_steps: steps of the warm-up (0: none).
        total_steps: steps of the whole training: those trained before this run and this run's.
    """

    kind: str
    learning_rate: float
    warmup_steps: int
    total_steps: int

    def __post_init__(self) -> None:
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"unknown lr_schedule {self.kind!r:.40}; use one of {', '.join(LR_SCHEDULES)}")
        if not (isinstance(self.learning_rate, (int, float)) and self.learning_rate > 0
                and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be a positive number, got {self.learning_rate!r:.40}")
        for name in ("warmup_steps", "total_steps"):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value <= _MAX_STEPS:
                raise ValueError(f"{name} must be a whole number from 0 to {_MAX_STEPS}, got {value!r:.40}")

    @property
    def is_constant(self) -> bool:
        """True when every step takes ``learning_rate``: the schedule changes nothing (ComfyUI's own trainer)."""
        return self.kind == "constant" and self.warmup_steps <= 1

    def factor(self, step: int) -> float:
        """The share of ``learning_rate`` that step ``step`` (0-based, over the whole training) takes, in (0, 1].

        A step past ``total_steps`` takes the last step's share.
        """
        if step < 0:
            raise ValueError(f"a step number is 0 or more, got {step}")
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay = self.total_steps - self.warmup_steps
        if self.kind == "constant" or decay <= 0:
            return 1.0
        progress = min(step - self.warmup_steps, decay - 1) / decay
        if self.kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress

    def rate(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based, over the whole training)."""
        return self.learning_rate * self.factor(step)

    def describe(self) -> str:
        """A phrase for the run's summary, e.g. ``cosine from 0.0001 over 1000 steps, 100 warm-up``."""
        steps = f"{self.total_steps} step{'' if self.total_steps == 1 else 's'}"
        what = f"{self.kind} at {self.learning_rate:g}" if self.kind == "constant" else \
            f"{self.kind} from {self.learning_rate:g} over {steps}"
        return what + (f", {self.warmup_steps} warm-up" if self.warmup_steps else "")

    def as_dict(self) -> dict[str, Any]:
        """The schedule as JSON values (a training state records the schedule its run trained with)."""
        return {"kind": self.kind, "learning_rate": float(self.learning_rate), "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps}

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> LrSchedule:
        """The schedule :meth:`as_dict` wrote.

        Raises:
            ValueError: a field missing, of the wrong type or out of range.
        """
        fields = ("kind", "learning_rate", "warmup_steps", "total_steps")
        if not isinstance(value, Mapping) or set(value) != set(fields):
            raise ValueError(f"an lr schedule has exactly the fields {', '.join(fields)}")
        if type(value["learning_rate"]) not in (int, float):
            raise ValueError(f"learning_rate must be a number, got {value['learning_rate']!r:.40}")
        return cls(value["kind"], float(value["learning_rate"]), value["warmup_steps"], value["total_steps"])
