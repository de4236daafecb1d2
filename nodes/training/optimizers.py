"""The optimizer of a run: ComfyUI's own for the names its trainer knows, so those train as the built-in node does,
:class:`~dataset_cache.prodigy.Prodigy` for ``Prodigy``, with the settings LoRA trainers use it with,
:class:`~dataset_cache.lion.Lion` for ``Lion``, with the ``lion-pytorch`` package's defaults (kohya's, when its
config sets no optimizer arguments), :class:`~dataset_cache.adafactor.Adafactor` for ``Adafactor``, with the
settings kohya's and FluxGym's recipes give it (:data:`ADAFACTOR_SETTINGS`), and
:class:`~dataset_cache.adamw8bit.AdamW8bit` for ``AdamW8bit`` and :class:`~dataset_cache.lion8bit.Lion8bit` for
``Lion8bit`` (bitsandbytes' defaults, kohya's and ai-toolkit's)."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch

from ...dataset_cache.adafactor import GROUP_STATE as ADAFACTOR_GROUP_STATE
from ...dataset_cache.adafactor import Adafactor
from ...dataset_cache.adamw8bit import AdamW8bit
from ...dataset_cache.lion import Lion
from ...dataset_cache.lion8bit import Lion8bit
from ...dataset_cache.optimizer_args import check_optimizer_args, format_optimizer_args, parse_optimizer_args
from ...dataset_cache.prodigy import GROUP_STATE, Prodigy

__all__ = ["ADAFACTOR_SETTINGS", "OPTIMIZER_CLASSES", "PRODIGY_SETTINGS", "check_args", "create_optimizer",
           "group_state", "optimizer_info", "optimizer_notes", "slots_differ"]

OPTIMIZER_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD, "RMSprop": torch.optim.RMSprop,
    "Prodigy": Prodigy, "Lion": Lion, "Adafactor": Adafactor, "AdamW8bit": AdamW8bit,
    "Lion8bit": Lion8bit}
"""The class each ``optimizer`` name makes (ComfyUI's ``_create_optimizer`` for the first four): what
``optimizer_args`` is checked against."""

PRODIGY_SETTINGS = {"weight_decay": 0.01, "use_bias_correction": True}
"""What Prodigy runs with besides its defaults: the settings kohya's and diffusers' LoRA guides give it (decoupled
weight decay 0.01, as this node's AdamW has; Adam's bias correction on the step size). ``safeguard_warmup`` follows
``warmup_steps``: on with a warm-up, as its authors advise."""


ADAFACTOR_SETTINGS = {"scale_parameter": False, "relative_step": False, "warmup_init": False}
"""What Adafactor runs with besides transformers' defaults: the settings kohya's Flux guides and FluxGym give it, so
``learning_rate`` (and ``lr_schedule``) set its step size. ``relative_step=True`` in ``optimizer_args`` gives it back
its own step size (``learning_rate`` then has no effect; the summary says so)."""


OURS = ("Prodigy", "Lion", "Adafactor", "AdamW8bit", "Lion8bit")
"""The optimizers this pack makes itself (the others are ComfyUI's ``_create_optimizer``'s)."""


def _own_kwargs(name: str, rate: float, warmup_steps: int, args: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments an optimizer named ``name`` is made with: the rate, our settings for ours, ``args``."""
    if name == "Prodigy":
        return {"lr": rate, "safeguard_warmup": warmup_steps > 0, **PRODIGY_SETTINGS, **args}
    if name == "Adafactor":
        merged = {**ADAFACTOR_SETTINGS, **args}
        return {**merged, "lr": None if merged["relative_step"] else rate}
    return {"lr": rate, **args}


def create_optimizer(train: ModuleType, settings: Any, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The run's optimizer over ``params`` at ``settings.learning_rate``: ComfyUI's ``_create_optimizer`` for its
    names, ours (:data:`OURS`: Prodigy with :data:`PRODIGY_SETTINGS`, Lion, Adafactor, AdamW8bit, Lion8bit) otherwise;
    ``settings.optimizer_args`` over their defaults
    (for ComfyUI's, its optimizer made again with its own defaults and them, so its class stays ComfyUI's choice)."""
    args = parse_optimizer_args(settings.optimizer_args)
    params = list(params)
    if settings.optimizer in OURS:
        cls = OPTIMIZER_CLASSES[settings.optimizer]
        return cls(params, **_own_kwargs(settings.optimizer, settings.learning_rate, settings.warmup_steps, args))
    optimizer = train._create_optimizer(settings.optimizer, params, settings.learning_rate)
    return _remade(optimizer, params, args) if args else optimizer


def _remade(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], changes: dict[str, Any]
            ) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class and settings, with ``changes``, over ``params``. Only the settings its
    constructor takes are passed on: torch's AdamW keeps Adam's ``decoupled_weight_decay`` among its defaults but
    takes no such argument."""
    accepted = inspect.signature(type(optimizer)).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(params, **{**settings, **changes})


def check_args(optimizer: str, text: object) -> None:
    """Refuse an ``optimizer_args`` that ``optimizer`` cannot take, before anything loads: its names and kinds
    (:func:`~dataset_cache.optimizer_args.check_optimizer_args`), then its values, by making the optimizer over one
    stand-in parameter (each optimizer's own range checks, e.g. a beta of 1).

    Raises:
        ValueError: naming ``optimizer_args`` and what is wrong.
    """
    args = parse_optimizer_args(text)
    if not args:
        return
    cls = OPTIMIZER_CLASSES[optimizer]
    check_optimizer_args(optimizer, cls, args)
    kwargs = _own_kwargs(optimizer, 1e-3, 0, args)
    try:
        cls([torch.zeros(1, requires_grad=True)], **kwargs)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(f"optimizer_args: {optimizer} refuses {format_optimizer_args(args)}: {exc}") from None


def slots_differ(optimizer: torch.optim.Optimizer, saved: Iterable[Iterable[str]]) -> str | None:
    """Why state slots ``saved`` (each parameter's slot names) cannot continue ``optimizer``, or ``None``: torch's
    optimizers keep other slots with some settings (``amsgrad``'s ``max_exp_avg_sq``, RMSprop's ``centered`` and
    ``momentum``), and stepping with a slot missing fails mid-run. The slots this one keeps are those of one step of
    its class and settings over a stand-in parameter. Ours (Prodigy, Lion) keep the same slots whatever their
    settings: ``None``."""
    if not type(optimizer).__module__.startswith("torch.optim"):
        return None
    param = torch.zeros(1, requires_grad=True)
    probe = _remade(optimizer, [param], {})
    param.grad = torch.zeros(1)
    probe.step()
    want = set(probe.state[param])
    for slots in saved:
        if set(slots) != want:
            return (f"it keeps {', '.join(sorted(slots))}, {type(optimizer).__name__} with this run's "
                    f"optimizer_args keeps {', '.join(sorted(want))}")
    return None


def group_state(optimizer: str) -> tuple[str, ...]:
    """The parameter-group values that carry ``optimizer``'s state between steps (restored with it)."""
    return {"Prodigy": GROUP_STATE, "Adafactor": ADAFACTOR_GROUP_STATE}.get(optimizer, ())


def optimizer_notes(settings: Any) -> list[str]:
    """What the summary says about the optimizer's settings: a Prodigy rate far below 1 (its rate multiplies the
    step size it finds, so 0.0005 trains 2,000 times slower than intended)."""
    if settings.optimizer == "Prodigy" and settings.learning_rate < 0.1:
        return [f"optimizer Prodigy finds its own step size and learning_rate {settings.learning_rate:g} multiplies "
                "it: set learning_rate to 1.0, as its authors advise (below 1 only to slow it down)"]
    if settings.optimizer == "Adafactor" and parse_optimizer_args(settings.optimizer_args).get("relative_step"):
        return ["optimizer Adafactor with relative_step=True finds its own step size (at most 0.01, falling as "
                "1/sqrt(step)): learning_rate and lr_schedule have no effect"]
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
