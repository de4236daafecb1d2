"""The run's memory plan, ComfyUI's side: the blocks, the probe, the memory free (ComfyUI's ``get_free_memory``, a
per-process cap when one is set), the plan (``dataset_cache.memory_plan``), and putting it in place around
ComfyUI's own model loading; undone when the run ends.

Who manages the weights: when ComfyUI already does, this plan keeps its hands off them (checkpointing only) and
says so. ComfyUI wins when the user turned ``offloading`` on (ComfyUI's partial loading, its weights streamed per
layer by its own ops), when the model is loaded with ComfyUI's dynamic VRAM (``comfy_aimdo``: weights paged in on
demand), and when ComfyUI runs with ``--lowvram``/``--novram``. Otherwise the whole model is loaded by ComfyUI
with the streamed blocks left out of that load (their weights go to pinned host memory instead).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

import comfy.model_management

from ...dataset_cache.host_activations import HostActivations
from ...dataset_cache.memory_plan import BlockCost, Budget, MemoryNeeds, MemoryPlan, MemoryRequest, plan_memory
from ...dataset_cache.transfers import transfers_for
from ...dataset_cache.units import format_bytes
from ...dataset_cache.weight_stream import WeightStreamer, block_tensors
from ...dataset_cache.block_runner import BlockRunners
from .blocks import Block, find_blocks
from .probe import OPTIMIZER_STATES, fp8_able, measure, probe_inputs
from .settings import TrainSettings

__all__ = ["MemoryStep", "comfy_manages", "device_budget", "plan_run_memory"]

log = logging.getLogger("streamcache.train")

_FP8 = torch.float8_e4m3fn


def comfy_manages(mp: Any, settings: TrainSettings) -> str:
    """Why ComfyUI manages this model's weights itself (then the plan only checkpoints), or ``""``."""
    if settings.offloading:
        return "offloading is on"
    if getattr(mp, "is_dynamic", lambda: False)():
        return "the model is loaded with dynamic VRAM"
    state = comfy.model_management.vram_state
    if state in (comfy.model_management.VRAMState.LOW_VRAM, comfy.model_management.VRAMState.NO_VRAM):
        return f"ComfyUI runs with --{state.name.lower().replace('_', '')}"
    return ""


def device_budget(device: torch.device, slots: int, already_there: int = 0) -> Budget:
    """What the run may use on ``device``: ComfyUI's free memory once every other model is unloaded (loading the
    training model unloads them anyway) plus ``already_there`` (the training model's own bytes already on the
    device), capped by a per-process fraction when one is set, less ComfyUI's reserve."""
    if device.type == "cuda":
        comfy.model_management.free_memory(1e30, device)
    free = int(comfy.model_management.get_free_memory(device))
    if device.type == "cuda":
        free += already_there
        fraction = torch.cuda.get_per_process_memory_fraction(device)
        if fraction < 1.0:
            total = torch.cuda.get_device_properties(device).total_memory
            free = min(free, int(fraction * total) - torch.cuda.memory_allocated(device))
        free -= int(comfy.model_management.extra_reserved_memory())
    host = int(comfy.model_management.get_free_memory(torch.device("cpu")))
    return Budget(max(0, free), host, slots)


def _trainable_bytes(lora_sd: dict[str, torch.Tensor], optimizer: str, averaged: bool = False) -> int:
    """The LoRA's bytes on the device: the weights, their gradients, the optimizer's state, and with ``ema_decay``
    their fp32 average and, for a LoRA not in fp32, its fp32 scratch copy (:mod:`dataset_cache.ema`)."""
    per_param = 2 + OPTIMIZER_STATES.get(optimizer, 2)  # the weight, its gradient, the optimizer's state
    average = sum(t.numel() * (4 if t.dtype == torch.float32 else 8) for t in lora_sd.values()) if averaged else 0
    return sum(t.numel() * t.element_size() for t in lora_sd.values()) * per_param + average


def _weights_only(blocks: list[Block], dm: torch.nn.Module, trainable: int, why: str) -> MemoryNeeds:
    """Needs from the weights alone, when the probe could not run (activations left out, and said so)."""
    ids = {id(t) for b in blocks for _o, _n, t in block_tensors(b.module)}
    costs = tuple(BlockCost(b.name, sum(t.numel() * t.element_size() for _o, _n, t in block_tensors(b.module)),
                            streamable=False) for b in blocks)
    other = sum(t.numel() * t.element_size() for _o, _n, t in block_tensors(dm) if id(t) not in ids)
    return MemoryNeeds(costs, other, trainable, measured=f"weights only: {why}")


@dataclass
class MemoryStep:
    """The plan of a run and what puts it in place: :meth:`place` before ComfyUI loads the model (and its
    :meth:`loading` context around that load), :meth:`release` when the run ends, whatever happened."""

    plan: MemoryPlan
    needs: MemoryNeeds
    blocks: list[Block]
    sequence: list[int]
    runners: BlockRunners
    how: str
    extra_notes: tuple[str, ...] = ()
    streamer: WeightStreamer | None = None
    host: HostActivations | None = None
    _undo: list[Callable[[], None]] = field(default_factory=list)

    def notes(self) -> tuple[str, ...]:
        """What the node's summary should say about memory (once)."""
        return (*self.extra_notes, *self.plan.notes)

    def out_of_memory_hint(self) -> str:
        """What to try when the run ran out of device memory with blocks kept whole (``""``: none were): the plan
        spent spare memory on speed, on an estimate."""
        if not self.plan.kept:
            return ""
        n = len(self.plan.names)
        return (f"Train LoRA memory: {len(self.plan.kept)} of {n} blocks were kept whole (not checkpointed) in memory "
                "the plan found free; set memory to 'no offload' to checkpoint every block, or free the device "
                "memory something else took since the run started")

    def place(self, mp: Any, device: torch.device) -> None:
        """Checkpoint the blocks, store fp8 where planned, pack the streamed blocks into host memory."""
        self.runners.checkpoint = self.plan.checkpoint
        self.runners.whole = {self.sequence[j] for j in self.plan.kept}  # forward order → block index
        none_checkpointed = not self.plan.checkpoint or len(self.plan.kept) == len(self.plan.names)
        if none_checkpointed and not self.plan.streamed and not self.runners.needs_copies():
            self.runners.remove()  # nothing to do around the blocks: their forwards stay ComfyUI's own
        if self.plan.fp8:
            _store_fp8(self.blocks, self._undo)
        if self.plan.streamed:
            streamed = [self.sequence[j] for j in self.plan.streamed]  # forward order
            for m in (m for i in streamed for m in self.blocks[i].module.modules()):
                _cast_on_use(m, self._undo)  # reached outside the runner, ComfyUI's op copies its host weight in
            self.streamer = WeightStreamer([(self.blocks[i].name, self.blocks[i].module) for i in streamed],
                                           transfers_for(device, pin=comfy.model_management.pin_memory,
                                                         unpin=comfy.model_management.unpin_memory))
            self.runners.streamer = self.streamer
            self.runners.streamed = {i: k for k, i in enumerate(streamed)}
            if self.streamer.stats.unpinned:
                log.warning("Train LoRA memory: %d of %d streamed blocks could not be pinned (ComfyUI's pinned-memory "
                            "budget, or --disable-pinned-memory): their copies are synchronous and slower",
                            self.streamer.stats.unpinned, len(streamed))
        if self.plan.host_activations:
            self.host = HostActivations(transfers_for(device))
            _wrap_forward(mp.model.diffusion_model, self.host, self._undo)

    @contextmanager
    def loading(self) -> Iterator[None]:
        """Around ComfyUI's load: the streamed blocks stay where they are (in host memory) when it moves the
        model to the device."""
        kept = [m for i in self.runners.streamed for m in self.blocks[i].module.modules()]
        for m in kept:
            m._apply = _staying(m)
        try:
            yield
        finally:
            for m in kept:
                m.__dict__.pop("_apply", None)

    def release(self) -> None:
        """Every block runner, hook and conversion undone; the streamed weights' slots and pinning given back."""
        if self.streamer is not None:
            self.streamer.close()
            self.runners.streamer = None
        while self._undo:
            self._undo.pop()()
        self.runners.remove()

    def report(self) -> dict[str, Any]:
        """The plan as data (the run's result carries it), with what the streamer did."""
        out = self.plan.as_dict()
        out["measured"] = self.needs.measured
        copied = self.runners.copied
        out["copied_inputs"] = "all" if copied is None else {self.blocks[i].name: sorted(map(str, p))
                                                             for i, p in copied.items()}
        out["out_of_place"] = [self.blocks[i].name for i in sorted(self.runners.out_of_place)]
        n = self.needs
        out["needs"] = {"weights": n.weight_bytes, "trainable": n.trainable_bytes, "held": n.held_bytes,
                        "held_checkpointed": n.held_checkpointed_bytes,
                        "largest_block_saved": max((b.saved_bytes for b in n.blocks), default=0),
                        "kept_saved": sum(n.blocks[i].saved_bytes for i in self.plan.kept)}
        out["blocks_found"] = self.how
        if self.streamer is not None:
            s = self.streamer.stats
            out["stream"] = {"uploads": s.uploads, "upload_bytes": s.upload_bytes, "hits": s.hits,
                             "misses": s.misses, "slot_bytes": s.slot_bytes, "unpinned": s.unpinned}
        if self.host is not None:
            out["host_activation_bytes"] = self.host.offloaded_bytes
        return out


def _staying(module: torch.nn.Module) -> Callable[..., torch.nn.Module]:
    """An ``nn.Module._apply`` that leaves ``module``'s tensors where they are (``.to()`` is built on it)."""
    def stay(fn: Any, recurse: bool = True) -> torch.nn.Module:
        return module
    return stay


def _cast_on_use(m: torch.nn.Module, undo: list[Callable[[], None]]) -> None:
    if hasattr(m, "comfy_cast_weights") and not m.comfy_cast_weights:
        m.comfy_cast_weights = True  # type: ignore[assignment]  # a flag of ComfyUI's cast ops (torch types
        # a module's attributes as tensors or modules)
        undo.append(lambda: setattr(m, "comfy_cast_weights", False))


def _store_fp8(blocks: Sequence[Block], undo: list[Callable[[], None]]) -> None:
    """Store the matrices of ComfyUI's ops in fp8 (e4m3fn, the probe's :func:`~.probe.fp8_able`); their cast upcasts
    each to the compute dtype on use."""
    able = {id(t) for b in blocks for t in fp8_able(b.module)}
    with torch.no_grad():
        for m in (m for b in blocks for m in b.module.modules()):
            weight = getattr(m, "weight", None)
            if isinstance(weight, torch.Tensor) and id(weight) in able:
                weight.data = weight.data.to(_FP8)
                _cast_on_use(m, undo)


def _wrap_forward(dm: torch.nn.Module, host: HostActivations, undo: list[Callable[[], None]]) -> None:
    original = dm.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with host.hooks():
            return original(*args, **kwargs)

    dm.forward = forward
    undo.append(lambda: dm.__dict__.pop("forward", None))


def _runners(blocks: Sequence[Block], settings: TrainSettings) -> BlockRunners:
    return BlockRunners([b.module for b in blocks], checkpoint=settings.gradient_checkpointing,
                        reentrant=settings.checkpoint_mode == "fast")


def _request(settings: TrainSettings, managed_by: str) -> MemoryRequest:
    return MemoryRequest(settings.memory, settings.gradient_checkpointing, settings.stream_blocks,
                         settings.allow_fp8, managed_by, batch_size=settings.batch_size)


def plan_run_memory(run: Any, reader: Any, samples: Sequence[Any], buckets: Sequence[tuple[int, ...]],
                    on_plan: Callable[[MemoryPlan], None] | None = None) -> MemoryStep:
    """Find the blocks, measure the run's needs (the probe), read the memory free and choose the plan; log it and
    hand it to ``on_plan`` before the first step."""
    settings, mp = run.settings, run.mp
    dm = mp.model.diffusion_model
    blocks, how = find_blocks(dm)
    runners = _runners(blocks, settings)
    trainable = _trainable_bytes(run.lora_sd, settings.optimizer, settings.ema_decay > 0)
    try:
        shape, conditioning = probe_inputs(reader, samples, buckets, settings.batch_size)
        probe = measure(mp, run.model_options, run.dtype, blocks, runners, shape, conditioning,
                        trainable_bytes=trainable, weight_copies=run.bypass is None)
        needs, order, runners.copied, runners.out_of_place = probe.needs, probe.order, probe.copied, \
            probe.out_of_place
        if probe.unfixed:
            log.warning("Train LoRA: %s modify tensors they saved for the backward pass in place even run out of "
                        "place; their gradients through those tensors will be wrong", ", ".join(probe.unfixed))
    except Exception as e:  # a model the fake pass cannot run: plan from the weights, and say so
        runners.remove()
        log.warning("Train LoRA: the memory probe failed (%s: %s); planning from the weights alone",
                    type(e).__name__, e)
        runners = _runners(blocks, settings)
        runners.copied = None  # which inputs a block modifies is not known: every block gets copies
        needs, order = _weights_only(blocks, dm, trainable, f"the probe failed ({type(e).__name__})"), []
    sequence = [*order, *(i for i in range(len(blocks)) if i not in order)]
    managed = comfy_manages(mp, settings)
    try:
        # the clone (and its adapters) may already sit on the device (ComfyUI loads a model there when it fits)
        there = sum(t.numel() * t.element_size() for t in [*(t for _o, _n, t in block_tensors(mp.model)),
                                                          *run.lora_sd.values()] if t.device == run.device)
        plan = plan_memory(needs, device_budget(run.device, 2, there), _request(settings, managed))
    except Exception:
        runners.remove()
        raise
    log.info("Train LoRA memory: %s (%s; blocks: %s; weights %s, trainable %s)", plan.describe(), needs.measured,
             how, format_bytes(needs.weight_bytes), format_bytes(trainable))
    for note in plan.notes:
        log.warning("Train LoRA memory: %s", note)
    if on_plan is not None:
        on_plan(plan)
    extra: tuple[str, ...] = ()
    if settings.checkpoint_depth and settings.gradient_checkpointing:
        extra = (f"checkpoint_depth {settings.checkpoint_depth} is no longer used: every block of the model is its "
                 "own gradient checkpoint (the same results, less memory than depth 1)",)
    return MemoryStep(plan, needs, blocks, sequence, runners, how, extra)

