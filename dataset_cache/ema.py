"""An exponential moving average of a LoRA's weights (EMA), the LoRA a run outputs when it averages.

OneTrainer, ai-toolkit and SimpleTuner can output, instead of the weights of the last step, their average over the
last steps, each step weighing ``1 - decay`` of what came before: the noise of the last batches averages out, which
on small datasets often gives a LoRA that generalizes better. The average is kept in fp32 whatever the LoRA's
dtype: a bf16 average would not move at all (at decay 0.999 a step changes it by 0.1% of the difference, below
bf16's resolution of 0.4%).

The decay of step ``t`` (optimizer steps done in total, the existing LoRA's included) is
``min(decay, (1 + t) / (10 + t))``, diffusers' ``EMAModel`` warm-up: the first steps are averaged with little
weight on the starting LoRA (a new one is noise), and the decay is a pure function of the step's number, so a
continued run averages exactly as the run that never stopped.

Cost: one fused ``lerp`` per device and dtype per step; a LoRA not in fp32 is first cast by one fused ``copy`` into an
fp32 scratch copy kept for the run (a cast per tensor would be a kernel launch per tensor and step, as many as the
optimizer's own). Memory: 4 bytes per weight for the average, 4 more for the scratch of a LoRA not in fp32. Off by
default (``decay`` 0), as in ComfyUI's own trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from .checks import check_number

__all__ = ["MAX_EMA_DECAY", "EMA_WARMUP", "WeightAverage", "check_ema_decay", "ema_decay_at"]

MAX_EMA_DECAY = 0.9999
"""The slowest average accepted: about the last 10,000 steps."""
EMA_WARMUP = 10
"""The warm-up's constant: step ``t`` decays by at most ``(1 + t) / (EMA_WARMUP + t)``."""


def check_ema_decay(value: object) -> None:
    """Refuse an ``ema_decay`` that is not 0 (no average) or a number from 0 to :data:`MAX_EMA_DECAY`.

    Raises:
        ValueError: naming ``ema_decay``, the value and the usual settings.
    """
    check_number("ema_decay", value, MAX_EMA_DECAY, zero="no average", hint="0.99 to 0.999 are usual")


def ema_decay_at(decay: float, step: int) -> float:
    """The decay the average takes at step ``step`` (1 for the first step, counted over the whole training)."""
    return min(decay, (1 + step) / (EMA_WARMUP + step))


class WeightAverage:
    """The fp32 moving average of ``params`` (LoRA key → parameter), each on its parameter's device.

    ``start`` gives the average to continue (a saved run's, by key); a key it lacks starts at its parameter's value.

    The parameters may move after the average is made: ComfyUI moves a LoRA's adapters to the training device when
    it loads the model (``move_weight_functions``), after Train LoRA made them (on the CPU when the model was not
    loaded). Each update and swap first follows them: an average whose parameter is elsewhere moves to it, once.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], decay: float,
                 start: Mapping[str, torch.Tensor] | None = None) -> None:
        self.decay = decay
        self.names = list(params)
        self.params = list(params.values())
        with torch.no_grad():
            self.average = [(start[n] if start is not None and n in start else p.detach())
                            .to(device=p.device, dtype=torch.float32, copy=True)
                            for n, p in zip(self.names, self.params)]
        self._devices: list[torch.device] = []
        self._groups: list[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]] = []
        self._place()

    def _place(self) -> None:
        """Follow the parameters: move each average to its parameter's device, and group them by device and dtype
        (per group the averages, the parameters, and for a LoRA not in fp32 an fp32 scratch copy of them that one
        fused cast fills at each update: listed once, so no op per tensor and step). Nothing to do while they stay
        (one device read per parameter)."""
        devices = [p.device for p in self.params]
        if devices == self._devices:
            return
        self.average = [a if a.device == d else a.to(d) for a, d in zip(self.average, devices)]
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, p in enumerate(self.params):
            groups.setdefault((p.device, p.dtype), []).append(i)
        self._groups = [([self.average[i] for i in indices], [self.params[i] for i in indices],
                         None if dtype == torch.float32 else
                         [torch.empty_like(self.params[i], dtype=torch.float32) for i in indices])
                        for (_, dtype), indices in groups.items()]
        self._devices = devices

    def update(self, step: int) -> None:
        """Average in the parameters' values after step ``step`` (1-based, over the whole training): no read back
        to the host, one fused lerp per device and dtype (after one fused cast for a LoRA not in fp32)."""
        weight = 1.0 - ema_decay_at(self.decay, step)
        self._place()
        with torch.no_grad():
            for average, params, scratch in self._groups:
                if scratch is not None:  # one fused cast (a kernel per ~100 tensors on a GPU, not one per tensor)
                    torch._foreach_copy_(scratch, params)
                torch._foreach_lerp_(average, params if scratch is None else scratch, weight)

    def weights(self) -> dict[str, torch.Tensor]:
        """The average as the LoRA a run outputs: each tensor in its parameter's dtype, detached, on the CPU."""
        return {n: a.to(device="cpu", dtype=p.dtype, copy=True)
                for n, a, p in zip(self.names, self.average, self.params)}

    def state(self) -> dict[str, torch.Tensor]:
        """The average itself (fp32, CPU copies), for a training state: continuing it continues exactly."""
        return {n: a.detach().to("cpu", copy=True) for n, a in zip(self.names, self.average)}

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The average in the parameters (rounded to their dtype) for the block, the trained values back after it,
        bit for bit: what a validation of the LoRA the run outputs measures."""
        self._place()
        with torch.no_grad():
            trained = [p.detach().clone() for p in self.params]
            for p, a in zip(self.params, self.average):
                p.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, t in zip(self.params, trained):
                    p.copy_(t)
