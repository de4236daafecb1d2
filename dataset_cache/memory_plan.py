"""How a training run uses device memory: from the sizes of the model's blocks, of what a forward keeps for the
backward pass and of the memory free, the cheapest plan that fits. Numbers in, a plan out: nothing here touches a
device, so every choice is unit-tested (the trainer measures the numbers; ``docs/ARCHITECTURE.md`` has the
arithmetic for the GPUs people own).

The plans, cheapest first (each costs time the one before does not):

1. every weight on the device, every block its own gradient checkpoint (no checkpointing at all when the user
   turned it off and it fits); under ``auto`` at batch size 1 (and under ``auto + keep blocks whole`` at any)
   the blocks whose recompute is dearest per byte are then kept whole (not checkpointed) while the estimate stays
   within :data:`SPARE_SHARE` of the memory this plan leaves free;
2. the weights of some blocks streamed from pinned host memory into a ring of device slots, the next block
   copied while the current one computes (forward and recompute): the fewest bytes streamed that make it fit;
3. as 2, with the tensors a checkpoint keeps (each block's inputs) held in host memory;
4. as 2 and 3 with the blocks' matrices stored in fp8, only where the user allowed it (a model loaded in fp8
   already counts its bytes as they are).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .units import format_bytes

__all__ = ["AUTO", "BlockCost", "Budget", "Estimate", "KEEP_WHOLE", "MEMORY_MODES", "MemoryNeeds", "MemoryPlan",
           "MemoryRequest", "NO_OFFLOAD", "SPARE_SHARE", "STREAM", "STREAM_HOST", "estimate", "pick_kept",
           "pick_streamed", "plan_memory", "spread"]

AUTO = "auto"
KEEP_WHOLE = "auto + keep blocks whole"
NO_OFFLOAD = "no offload"
STREAM = "stream blocks"
STREAM_HOST = "stream blocks + host activations"
MEMORY_MODES = (AUTO, KEEP_WHOLE, NO_OFFLOAD, STREAM, STREAM_HOST)
"""The ``memory`` choices: the plan picked for the user (``auto``; with blocks kept whole at any batch size), or one
rung fixed by an expert."""

BACKWARD_FACTOR = 1.5
"""A block's backward holds what its recompute saved plus the gradients it makes on the way (each op's output
gradient lives until its inputs' gradients exist): half as much again covers the transformer and UNet blocks of
the families trained (the bench's measured peaks are compared with the estimate in docs/BENCHMARKS.md)."""
RESERVE = 0.05
"""Share of the estimate kept free for what it does not itemize: the caching allocator's rounding and
fragmentation, cuBLAS workspaces, the batch itself."""
DEFAULT_SLOTS = 2
"""Device slots for streamed blocks: the block computing and the next one arriving."""
SPARE_SHARE = 0.5
"""Share of the memory the checkpointed plan leaves free that is spent on keeping blocks whole: a kept block is not
recomputed in the backward pass (at batch 1 a GPU step is bound by the host's ops, and a recompute is a third of
them); the other half stays free for what the estimate does not see and for the user's other work."""


@dataclass(frozen=True)
class BlockCost:
    """One block of the diffusion model, as memory.

    Attributes:
        name: its module path (for messages).
        weight_bytes: its parameters and buffers as stored for the run.
        saved_bytes: what its forward saves for the backward pass (activations and the weight copies ComfyUI's
            ops make): what its recompute holds during its backward.
        input_bytes: its tensor inputs (what a checkpoint keeps of it; uploaded again before its recompute when
            kept in host memory).
        fp8_weight_bytes: its bytes with every floating-point matrix stored in fp8 (``None``: fp8 does not apply,
            e.g. it is fp8 already).
        streamable: whether its weights can be streamed (plain tensors, not shared with another block, and its
            forward runs through the block: the probe saw it).
        saves: tensors its forward saves for the backward pass: the measure of what its recompute replays (ops
            and the checkpoint's per-tensor hooks) that :func:`pick_kept` weighs against its bytes (0: unknown).
    """

    name: str
    weight_bytes: int
    saved_bytes: int = 0
    input_bytes: int = 0
    fp8_weight_bytes: int | None = None
    streamable: bool = True
    saves: int = 0


@dataclass(frozen=True)
class MemoryNeeds:
    """What a run of this model at this batch shape needs, measured before its first step.

    Attributes:
        blocks: the blocks, in the order the forward runs them.
        other_weight_bytes: parameters outside the blocks (embedders, final layers): always on the device.
        trainable_bytes: adapter weights, their gradients and the optimizer's state.
        held_bytes: kept for the backward pass over a forward without checkpointing.
        held_checkpointed_bytes: kept with every block checkpointed (the blocks' inputs, what the rest saves).
        largest_weight_bytes: the largest single weight (ComfyUI's ops make a patched copy of the weight in use).
        measured: how the activation figures were obtained (for the report).
    """

    blocks: tuple[BlockCost, ...]
    other_weight_bytes: int = 0
    trainable_bytes: int = 0
    held_bytes: int = 0
    held_checkpointed_bytes: int = 0
    largest_weight_bytes: int = 0
    measured: str = "probe"

    @property
    def weight_bytes(self) -> int:
        return self.other_weight_bytes + sum(b.weight_bytes for b in self.blocks)


@dataclass(frozen=True)
class Budget:
    """What the run may use.

    Attributes:
        device_bytes: device memory free for the run (free memory, or what a per-process cap leaves), less the
            reserve ComfyUI keeps for other programs.
        host_bytes: host memory free for copies of activations (``None``: not limited).
        slots: device slots for streamed blocks.
    """

    device_bytes: int
    host_bytes: int | None = None
    slots: int = DEFAULT_SLOTS


@dataclass(frozen=True)
class MemoryRequest:
    """What the user asked for.

    Attributes:
        mode: one of :data:`MEMORY_MODES`.
        checkpoint: the ``gradient_checkpointing`` input (streaming turns it on: a streamed block must be
            recomputed in the backward pass, its weights present again).
        stream_blocks: with a stream mode, how many blocks (0: as many as needed to fit).
        spare_share: where blocks are kept whole, the share of the memory the checkpointed plan leaves free that
            they may take (0: every block checkpointed).
        batch_size: rows per step on the device. ``auto`` keeps blocks whole at 1 only: there the step waits on
            the host and a kept block's activations are the smallest; from 2 on they grow with the batch (on a
            large GPU, past what ComfyUI's own node holds in all), so ``auto`` holds the least memory without
            streaming (``auto + keep blocks whole`` spends the spare memory at any batch size).
        allow_fp8: the blocks' matrices may be stored in fp8 when nothing else fits (``auto``) or always (stream
            modes).
        managed_by: non-empty when ComfyUI manages the weights itself (its offloading, dynamic VRAM, --lowvram):
            the reason; then only checkpointing is this plan's.
    """

    mode: str = AUTO
    checkpoint: bool = True
    stream_blocks: int = 0
    allow_fp8: bool = False
    managed_by: str = ""
    spare_share: float = SPARE_SHARE
    batch_size: int = 1

    @property
    def keeps_whole(self) -> bool:
        """Whether spare memory goes to blocks kept whole (module docstring, rung 1)."""
        return self.mode == KEEP_WHOLE or (self.mode == AUTO and self.batch_size <= 1)


@dataclass(frozen=True)
class Estimate:
    """Device bytes of a plan, item by item (``total`` is what must fit)."""

    weights: int
    slots: int
    activations: int
    trainable: int
    copies: int

    @property
    def subtotal(self) -> int:
        return self.weights + self.slots + self.activations + self.trainable + self.copies

    @property
    def reserve(self) -> int:
        return int(self.subtotal * RESERVE)

    @property
    def total(self) -> int:
        return self.subtotal + self.reserve


@dataclass(frozen=True)
class MemoryPlan:
    """The plan a run trains with, and its estimate.

    Attributes:
        mode: what the user asked (:data:`MEMORY_MODES`).
        checkpoint: every block is its own gradient checkpoint (but those in ``kept``).
        streamed: indices (into ``names``) of the blocks whose weights are streamed.
        host_activations: what a checkpoint keeps lives in host memory.
        fp8: the blocks' matrices are stored in fp8.
        estimate: device bytes, item by item.
        budget_bytes: what the run may use.
        names: every block's name, in forward order.
        managed_by: ComfyUI manages the weights (the reason), or ``""``.
        transfer_bytes: weight bytes copied to the device per forward pass (twice per step: forward and recompute).
        notes: what the user should know (an override that does not fit, checkpointing turned on, ...).
        kept: indices (into ``names``) of the blocks kept whole although ``checkpoint``: their activations stay
            from the forward to their backward, and they are not recomputed.
        keepable: under ``auto`` at a batch size above 1, the blocks ``auto + keep blocks whole`` would keep
            (the plan says so, so the user can choose speed), and ``keepable_bytes`` what they would add.
    """

    mode: str
    checkpoint: bool
    streamed: tuple[int, ...]
    host_activations: bool
    fp8: bool
    estimate: Estimate
    budget_bytes: int
    names: tuple[str, ...]
    managed_by: str = ""
    transfer_bytes: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)
    kept: tuple[int, ...] = ()
    keepable: tuple[int, ...] = ()
    keepable_bytes: int = 0

    @property
    def fits(self) -> bool:
        return self.estimate.total <= self.budget_bytes

    def describe(self) -> str:
        """``"blocks checkpointed, 22 of 57 blocks streamed, estimated 11.2 GiB of 12.0 GiB"``."""
        n = len(self.names)
        if not self.checkpoint:
            parts = ["no checkpointing"]
        elif self.kept:
            parts = [f"{n - len(self.kept)} of {n} blocks checkpointed ({len(self.kept)} kept whole in spare memory)"]
        elif self.keepable:
            parts = [f"{n} blocks checkpointed ('{KEEP_WHOLE}' would keep {len(self.keepable)} whole, faster, in "
                     f"{format_bytes(self.keepable_bytes)} more)"]
        else:
            parts = [f"{n} blocks checkpointed"]
        if self.managed_by:
            parts.append(f"weights managed by ComfyUI ({self.managed_by})")
        elif self.streamed:
            parts.append(f"{len(self.streamed)} of {len(self.names)} blocks streamed "
                         f"({format_bytes(self.transfer_bytes)} copied per pass)")
        else:
            parts.append("all weights on the device")
        if self.host_activations:
            parts.append("checkpointed activations in host memory")
        if self.fp8:
            parts.append("block weights stored in fp8")
        text = ", ".join(parts)
        if self.managed_by:  # ComfyUI decides what sits on the device: an estimate of this plan would mislead
            return text
        text += f", estimated {format_bytes(self.estimate.total)} of {format_bytes(self.budget_bytes)}"
        if not self.fits:
            text += " (more than is free: the run may run out of memory)"
        return text

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain data (the run's result carries it; the GPU bench records it)."""
        e = self.estimate
        return {
            "mode": self.mode, "checkpoint": self.checkpoint, "blocks": len(self.names),
            "streamed_blocks": len(self.streamed), "streamed": [self.names[i] for i in self.streamed],
            "kept_blocks": len(self.kept), "kept": [self.names[i] for i in self.kept],
            "keepable_blocks": len(self.keepable), "keepable_bytes": self.keepable_bytes,
            "host_activations": self.host_activations, "fp8": self.fp8, "managed_by": self.managed_by,
            "estimate_bytes": e.total, "budget_bytes": self.budget_bytes, "fits": self.fits,
            "transfer_bytes_per_pass": self.transfer_bytes,
            "estimate": {"weights": e.weights, "slots": e.slots, "activations": e.activations,
                         "trainable": e.trainable, "copies": e.copies, "reserve": e.reserve},
            "notes": list(self.notes), "description": self.describe(),
        }


def _weights(needs: MemoryNeeds, fp8: bool) -> list[int]:
    return [b.fp8_weight_bytes if fp8 and b.fp8_weight_bytes is not None else b.weight_bytes for b in needs.blocks]


def estimate(needs: MemoryNeeds, *, checkpoint: bool, streamed: Sequence[int] = (), host_activations: bool = False,
             fp8: bool = False, slots: int = DEFAULT_SLOTS, kept: Sequence[int] = ()) -> Estimate:
    """Device bytes of one plan at its peak (the backward pass of the block that saves the most; a kept block's
    activations held from the forward on, its backward adding its gradients)."""
    weights = _weights(needs, fp8)
    chosen = set(streamed)
    resident = needs.other_weight_bytes + sum(w for i, w in enumerate(weights) if i not in chosen)
    slot_bytes = slots * max((weights[i] for i in chosen), default=0)
    largest_saved = max((b.saved_bytes for b in needs.blocks), default=0)
    if not checkpoint:
        activations = needs.held_bytes + int(largest_saved * (BACKWARD_FACTOR - 1))
    elif host_activations:  # the device keeps one block's inputs (back for its recompute) and its backward
        activations = max((b.input_bytes for b in needs.blocks), default=0) + int(largest_saved * BACKWARD_FACTOR)
    elif kept:
        whole = set(kept)
        saved = [b.saved_bytes for b in needs.blocks]
        recomputed = max((s for i, s in enumerate(saved) if i not in whole), default=0)
        peak = max(int(recomputed * BACKWARD_FACTOR), max(int(saved[i] * (BACKWARD_FACTOR - 1)) for i in whole))
        activations = needs.held_checkpointed_bytes + sum(saved[i] for i in whole) + peak
    else:
        activations = needs.held_checkpointed_bytes + int(largest_saved * BACKWARD_FACTOR)
    return Estimate(resident, slot_bytes, activations, needs.trainable_bytes, 2 * needs.largest_weight_bytes)


def spread(candidates: Sequence[int], k: int) -> list[int]:
    """``k`` of ``candidates`` (indices in forward order) spread evenly over them: a streamed block's copy then
    overlaps the compute of the resident blocks before it, instead of streamed blocks queueing behind each other."""
    n = len(candidates)
    if k >= n:
        return list(candidates)
    return [candidates[int((j + 0.5) * n / k)] for j in range(k)]


def pick_streamed(weights: Sequence[int], need: int, slots: int = DEFAULT_SLOTS,
                  streamable: Sequence[bool] | None = None) -> tuple[int, ...] | None:
    """The blocks to stream so that the device holds at least ``need`` bytes less, streaming the fewest bytes.

    Streaming blocks saves their bytes but costs ``slots`` copies of the largest of them, so for each possible
    largest block the largest blocks up to it are taken first (fewest blocks), equal ones spread over the forward
    order; of those choices the one copying the fewest bytes per pass wins (then the fewest blocks). ``None``:
    streaming every block saves less than ``need``.
    """
    if need <= 0:
        return ()
    ok = [w > 0 and (streamable is None or streamable[i]) for i, w in enumerate(weights)]
    best: tuple[int, int, tuple[int, ...]] | None = None
    for cap in sorted({w for i, w in enumerate(weights) if ok[i]}):
        chosen: list[int] = []
        total = 0
        for size in sorted({w for i, w in enumerate(weights) if ok[i] and w <= cap}, reverse=True):
            group = [i for i, w in enumerate(weights) if ok[i] and w == size]
            missing = need - (total - slots * cap)
            k = min(len(group), max(0, math.ceil(missing / size)))
            chosen += spread(group, k)
            total += k * size
            if total - slots * cap >= need:
                break
        if chosen and total - slots * cap >= need:
            option = (total, len(chosen), tuple(sorted(chosen)))
            if best is None or option[:2] < best[:2]:
                best = option
    return best[2] if best is not None else None


def pick_kept(needs: MemoryNeeds, limit: int, fp8: bool = False) -> tuple[int, ...]:
    """The blocks to keep whole (not checkpointed) with every weight on the device, the estimate at most ``limit``.

    Most recompute saved per byte first: blocks by saved tensors per saved byte (a low-resolution UNet block
    replays as many ops as a high-resolution one for a fraction of its activations), smallest first where the
    probe counted none; a block that does not fit is passed over for smaller ones after it."""
    def value(i: int) -> tuple[float, int, int]:
        b = needs.blocks[i]
        return (-(b.saves or 1) / max(b.saved_bytes, 1), b.saved_bytes, i)

    chosen: list[int] = []
    for i in sorted(range(len(needs.blocks)), key=value):
        trial = [*chosen, i]
        if estimate(needs, checkpoint=True, fp8=fp8, kept=trial).total <= limit:
            chosen = trial
    return tuple(sorted(chosen))


def _largest_first(weights: Sequence[int], k: int, streamable: Sequence[bool]) -> tuple[int, ...]:
    """``k`` blocks for an expert's fixed count: the largest, equal ones spread over the forward order."""
    chosen: list[int] = []
    for size in sorted({w for i, w in enumerate(weights) if streamable[i] and w > 0}, reverse=True):
        group = [i for i, w in enumerate(weights) if streamable[i] and w == size]
        chosen += spread(group, min(len(group), k - len(chosen)))
        if len(chosen) >= k:
            break
    return tuple(sorted(chosen))


@dataclass(frozen=True)
class _Option:
    checkpoint: bool
    stream: bool
    host: bool
    fp8: bool


def _make(needs: MemoryNeeds, budget: Budget, request: MemoryRequest, option: _Option,
          streamed: tuple[int, ...], notes: Sequence[str] = (), kept: tuple[int, ...] = ()) -> MemoryPlan:
    weights = _weights(needs, option.fp8)
    est = estimate(needs, checkpoint=option.checkpoint, streamed=streamed, host_activations=option.host,
                   fp8=option.fp8, slots=budget.slots, kept=kept)
    return MemoryPlan(request.mode, option.checkpoint, streamed, option.host, option.fp8, est, budget.device_bytes,
                      tuple(b.name for b in needs.blocks), request.managed_by, sum(weights[i] for i in streamed),
                      tuple(notes), kept)


def _keep_whole(needs: MemoryNeeds, request: MemoryRequest, plan: MemoryPlan) -> MemoryPlan:
    """``plan`` (every block checkpointed, every weight on the device, fitting) with the blocks kept whole that
    :data:`SPARE_SHARE` of the memory it leaves free holds; where the request does not keep blocks whole, the plan
    names them as ``keepable``."""
    if not plan.checkpoint or plan.streamed or plan.host_activations or not plan.fits or request.spare_share <= 0:
        return plan
    spare = plan.budget_bytes - plan.estimate.total
    limit = plan.estimate.total + int(min(request.spare_share, 1.0) * spare)
    kept = pick_kept(needs, limit, plan.fp8)
    if not kept:
        return plan
    whole = estimate(needs, checkpoint=True, fp8=plan.fp8, kept=kept)
    if request.keeps_whole:
        return dataclasses.replace(plan, kept=kept, estimate=whole)
    return dataclasses.replace(plan, keepable=kept, keepable_bytes=whole.total - plan.estimate.total)


def _fitted(needs: MemoryNeeds, budget: Budget, request: MemoryRequest, option: _Option,
            notes: Sequence[str] = ()) -> MemoryPlan | None:
    """``option`` with the fewest streamed bytes that fit (``None``: it cannot fit)."""
    if not option.stream:
        plan = _make(needs, budget, request, option, (), notes)
        return plan if plan.fits else None
    base = estimate(needs, checkpoint=True, host_activations=option.host, fp8=option.fp8, slots=0).total
    need = math.ceil((base - budget.device_bytes) / (1 + RESERVE))  # the reserve shrinks with what is streamed
    streamable = [b.streamable for b in needs.blocks]
    streamed = pick_streamed(_weights(needs, option.fp8), need, budget.slots, streamable)
    if streamed is None:
        return None
    plan = _make(needs, budget, request, option, streamed, notes)
    weights = _weights(needs, option.fp8)
    while not plan.fits:  # the reserve's rounding: one more block, the largest that keeps the slots' size
        cap = max(weights[i] for i in plan.streamed)
        rest = [i for i, ok in enumerate(streamable) if ok and i not in plan.streamed and weights[i]]
        if not rest:
            return None
        within = [i for i in rest if weights[i] <= cap]
        extra = max(within, key=lambda i: weights[i]) if within else min(rest, key=lambda i: weights[i])
        plan = _make(needs, budget, request, option, tuple(sorted((*plan.streamed, extra))), notes)
    return plan


def _ladder(request: MemoryRequest, fp8_options: Sequence[bool]) -> list[_Option]:
    rungs: list[_Option] = []
    for fp8 in fp8_options:
        if not request.checkpoint:
            rungs.append(_Option(False, False, False, fp8))
        rungs += [_Option(True, False, False, fp8), _Option(True, True, False, fp8), _Option(True, True, True, fp8)]
    return rungs


def plan_memory(needs: MemoryNeeds, budget: Budget, request: MemoryRequest) -> MemoryPlan:
    """The plan for ``request``: ``auto`` picks the first rung of the ladder (module docstring) that fits, or the
    most frugal one with a note when none does; the other modes fix a rung and say when it does not fit."""
    if request.mode not in MEMORY_MODES:
        raise ValueError(f"unknown memory {request.mode!r}; use one of {', '.join(MEMORY_MODES)}")
    notes: list[str] = []
    if request.managed_by:
        if request.mode in (STREAM, STREAM_HOST):
            raise ValueError(f"memory {request.mode!r} streams weights itself, but ComfyUI manages this model's "
                             f"weights ({request.managed_by}): turn offloading off or set memory to auto")
        return _make(needs, budget, request, _Option(request.checkpoint, False, False, False), ())
    convertible = any(b.fp8_weight_bytes is not None for b in needs.blocks)
    if request.mode in (AUTO, KEEP_WHOLE):
        fp8_options = [False, True] if request.allow_fp8 and convertible else [False]
        rungs = _ladder(request, fp8_options)
        for option in rungs:
            plan = _fitted(needs, budget, request, option)
            if plan is not None:
                plan = _keep_whole(needs, request, plan)
                if option.checkpoint and not request.checkpoint:
                    plan = _with_note(plan, "gradient_checkpointing was off, but the run does not "
                                                           "fit without it: blocks are checkpointed")
                return plan
        frugal = rungs[-1]
        all_blocks = tuple(i for i, b in enumerate(needs.blocks) if b.streamable and b.weight_bytes)
        notes.append("no plan fits the memory free: everything that can be streamed is; lower batch_size or the "
                     "resolution" + ("" if request.allow_fp8 or not convertible else ", or allow fp8 weights"))
        return _make(needs, budget, request, frugal, all_blocks, notes)
    fp8 = request.allow_fp8 and convertible
    if request.mode == NO_OFFLOAD:
        plan = _make(needs, budget, request, _Option(request.checkpoint, False, False, fp8), ())
        return plan if plan.fits else _with_note(
            plan, f"memory {NO_OFFLOAD!r} does not fit the estimate; 'auto' would stream blocks")
    host = request.mode == STREAM_HOST
    if not request.checkpoint:
        notes.append("streamed weights need gradient checkpointing (a block's weights come back for its recompute): "
                     "blocks are checkpointed")
    option = _Option(True, True, host, fp8)
    if request.stream_blocks > 0:
        streamable = [b.streamable for b in needs.blocks]
        count = min(request.stream_blocks, sum(streamable))
        return _make(needs, budget, request, option, _largest_first(_weights(needs, fp8), count, streamable), notes)
    plan = _fitted(needs, budget, request, option, notes)
    if plan is None:
        all_blocks = tuple(i for i, b in enumerate(needs.blocks) if b.streamable and b.weight_bytes)
        plan = _make(needs, budget, request, option, all_blocks, (*notes, "even every block streamed does not fit "
                                                                         "the estimate"))
    return plan


def _with_note(plan: MemoryPlan, note: str) -> MemoryPlan:
    return dataclasses.replace(plan, notes=(*plan.notes, note))
