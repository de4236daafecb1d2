"""The optimizer of a run: ComfyUI's own for the names its trainer knows, so those train as the built-in node does,
:class:`~dataset_cache.prodigy.Prodigy` for ``Prodigy``, with the settings LoRA trainers use it with, and
:class:`~dataset_cache.lion.Lion` for ``Lion``, with the ``lion-pytorch`` package's defaults (kohya's, when its
config sets no optimizer arguments)."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch

from ...dataset_cache.lion import Lion
from ...dataset_cache.prodigy import GROUP_STATE, Prodigy

__all__ = ["PRODIGY_SETTINGS", "create_optimizer", "group_state", "optimizer_info", "optimizer_notes"]

PRODIGY_SETTINGS = {"weight_decay": 0.01, "use_bias_correction": True}
"""What Prodigy runs with besides its defaults: the settings kohya's and diffusers' LoRA guides give it (decoupled
weight decay 0.01, as this node's AdamW has; Adam's bias correction on the step size). ``safeguard_warmup`` follows
``warmup_steps``: on with a warm-up, as its authors advise."""


def create_optimizer(train: ModuleType, settings: Any, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The run's optimizer over ``params`` at ``settings.learning_rate``: ComfyUI's ``_create_optimizer`` for its
    names, Prodigy (:data:`PRODIGY_SETTINGS`) and Lion otherwise."""
    if settings.optimizer == "Lion":
        return Lion(params, lr=settings.learning_rate)
    if settings.optimizer == "Prodigy":
        return Prodigy(params, lr=settings.learning_rate, safeguard_warmup=settings.warmup_steps > 0,
                       **PRODIGY_SETTINGS)
    return train._create_optimizer(settings.optimizer, params, settings.learning_rate)


def group_state(optimizer: str) -> tuple[str, ...]:
    """The parameter-group values that carry ``optimizer``'s state between steps (restored with it)."""
    return GROUP_STATE if optimizer == "Prodigy" else ()


def optimizer_notes(settings: Any) -> list[str]:
    """What the summary says about the optimizer's settings: a Prodigy rate far below 1 (its rate multiplies the
    step size it finds, so 0.0005 trains 2,000 times slower than intended)."""
    if settings.optimizer == "Prodigy" and settings.learning_rate < 0.1:
        return [f"optimizer Prodigy finds its own step size and learning_rate {settings.learning_rate:g} multiplies "
                "it: set learning_rate to 1.0, as its authors advise (below 1 only to slow it down)"]
    return []


def optimizer_info(optimizer: Any) -> list[str]:
    """What the summary says about the optimizer once the steps are done: the step size Prodigy found (``d`` times
    the last step's rate is the rate Adam would have stepped at: a learning rate for AdamW, found)."""
    if not isinstance(optimizer, Prodigy):
        return []
    group = optimizer.param_groups[0]
    d, rate = float(group["d"]), float(group["lr"])
    return [f"Prodigy's step size at the last step: d = {d:.3g}, so Adam's rate was learning_rate × d = "
            f"{rate * d:.3g}"]
