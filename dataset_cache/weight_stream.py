"""Streaming the weights of chosen blocks of a model from host memory into a ring of device slots.

Each streamed block's parameters and buffers are packed into one flat host buffer (pinned on CUDA: one
asynchronous copy per block) and its tensors become views of it. When the block runs, :meth:`WeightStreamer.enter`
points its tensors at a device slot holding the same bytes, and the next blocks the run will need are copied into
the other slots meanwhile, so a copy overlaps the compute of the blocks before it. Blocks run in forward order,
then (each its own gradient checkpoint) again in reverse order for their recompute; the slots follow that order
across the steps: the last block of a forward is still in its slot for its recompute, the first recomputed block
for the next forward.

When a slot may be overwritten: in the forward pass, once the block has left (nothing of a checkpointed block
keeps its weights); in the backward pass, once the *next* streamed block's recompute starts: autograd runs a
graph's nodes in decreasing order of creation, so by then every node of the later block, which may hold its
weights, has been enqueued. A marker of the compute enqueued at that moment orders the overwrite after it.

Between uses a block's tensors point at their host copies, so anything that reaches them outside
``enter``/``leave`` reads correct weights (ComfyUI's ops copy a host weight to the device per op).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .transfers import Transfers

__all__ = ["ALIGN", "StreamStats", "WeightStreamer", "block_tensors", "streamable"]

ALIGN = 256
"""Byte alignment of each tensor in a block's flat buffers (CUDA's allocation granularity for fast kernels)."""


def block_tensors(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` and its submodules: ``(owner, name, tensor)``."""
    out = []
    for owner in module.modules():
        for name, tensor in [*owner._parameters.items(), *owner._buffers.items()]:
            if tensor is not None:
                out.append((owner, name, tensor))
    return out


def streamable(module: torch.nn.Module) -> str:
    """Why ``module`` cannot be streamed, or ``""`` when it can: its tensors must be plain strided tensors (not a
    quantized tensor class, which holds more than its data) that are not trained (a trained parameter's gradient
    and optimizer state live with it)."""
    for owner, name, tensor in block_tensors(module):
        data = tensor.data
        if type(data) is not torch.Tensor or data.layout != torch.strided:
            return f"{type(owner).__name__}.{name} is a {type(data).__name__}"
        if tensor.requires_grad:
            return f"{type(owner).__name__}.{name} is trained"
    return ""


@dataclass
class _Block:
    name: str
    tensors: list[torch.Tensor]
    offsets: list[int]
    nbytes: int
    host: torch.Tensor
    host_views: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Slot:
    buffer: torch.Tensor
    block: int | None = None
    ready: Any = None
    free_after: Any = None
    held: bool = False
    last_use: int = 0


@dataclass
class StreamStats:
    """What the streamer did: copies (blocks and bytes), uses served by a slot that already held the block, uses
    that had to copy first (a prefetch that did not happen), the device bytes of its slots, and the blocks whose
    host copy could not be pinned (their copies to a CUDA device then wait for the CPU)."""

    uploads: int = 0
    upload_bytes: int = 0
    hits: int = 0
    misses: int = 0
    slot_bytes: int = 0
    unpinned: int = 0


def _view(flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    nbytes = like.numel() * like.element_size()
    return flat[offset:offset + nbytes].view(like.dtype).view(like.shape)


class WeightStreamer:
    """Streams the weights of ``blocks`` (``(name, module)`` in forward order) through ``slots`` device slots.

    The caller calls :meth:`enter` before a block computes (``recompute``: in the backward pass) and :meth:`leave`
    after, and :meth:`close` at the end (tensors stay views of their host copies, which stay readable).
    """

    def __init__(self, blocks: Sequence[tuple[str, torch.nn.Module]], transfers: Transfers, *,
                 slots: int = 2) -> None:
        if slots < 2:
            raise ValueError(f"the weight streamer needs at least 2 slots (one computing, one loading), got {slots}")
        self.transfers = transfers
        self.stats = StreamStats()
        self._blocks = [self._pack(name, module) for name, module in blocks]
        size = max((b.nbytes for b in self._blocks), default=0)
        self._slots = [_Slot(transfers.device_buffer(size)) for _ in range(min(slots, max(1, len(self._blocks))))]
        self.stats.slot_bytes = size * len(self._slots)
        self._clock = 0

    def _pack(self, name: str, module: torch.nn.Module) -> _Block:
        """Move the block's tensors into one host buffer (views of it from now on)."""
        why = streamable(module)
        if why:
            raise ValueError(f"block {name} cannot be streamed: {why}")
        tensors: list[torch.Tensor] = []
        seen: set[int] = set()
        for _owner, _name, tensor in block_tensors(module):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                tensors.append(tensor)
        offsets, end = [], 0
        for t in tensors:
            offsets.append(end)
            end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        host = self.transfers.host_buffer(end)
        if self.transfers.device.type == "cuda" and end and not host.is_pinned():
            self.stats.unpinned += 1
        block = _Block(name, tensors, offsets, end, host)
        with torch.no_grad():
            for t, offset in zip(tensors, offsets):
                view = _view(host, offset, t.data)
                view.copy_(t.data)
                block.host_views.append(view)
                t.data = view
        return block

    @property
    def slot_count(self) -> int:
        return len(self._slots)

    def resident(self) -> list[int]:
        """The blocks whose bytes sit in a slot (loaded, loading, or kept from their last use)."""
        return [s.block for s in self._slots if s.block is not None]

    def slot_buffers(self) -> list[torch.Tensor]:
        """The device slots (for tests and reports)."""
        return [s.buffer for s in self._slots]

    def enter(self, index: int, *, recompute: bool) -> None:
        """Block ``index`` is about to compute: its weights are in a slot (the compute waits for their copy),
        its tensors point at them, and the next blocks start copying into the other slots."""
        for slot in self._slots:  # the blocks held from the backward pass: their backward is enqueued by now
            if slot.held:
                self._release(slot)
        found = self._slot_of(index)
        if found is None:
            self.stats.misses += 1
            slot = self._load(index, self._upcoming(index, recompute))
        else:
            self.stats.hits += 1
            slot = found
        self.transfers.wait(slot.ready)
        slot.ready = None
        slot.held = True
        self._clock += 1
        slot.last_use = self._clock
        block = self._blocks[index]
        for t, offset in zip(block.tensors, block.offsets):
            t.data = _view(slot.buffer, offset, t.data)
        self._prefetch(index, recompute)

    def leave(self, index: int, *, recompute: bool) -> None:
        """Block ``index`` computed. In the forward pass its slot may be reused after that compute; in the
        backward pass it stays until the next streamed block's recompute starts (its backward comes first)."""
        if recompute:
            return
        slot = self._slot_of(index)
        if slot is not None and slot.held:
            self._release(slot)

    def _release(self, slot: _Slot) -> None:
        slot.held = False
        slot.free_after = self.transfers.mark()
        if slot.block is not None:
            block = self._blocks[slot.block]
            for t, view in zip(block.tensors, block.host_views):
                t.data = view

    def _slot_of(self, index: int) -> _Slot | None:
        return next((s for s in self._slots if s.block == index), None)

    def _upcoming(self, index: int, recompute: bool) -> list[int]:
        """The blocks needed after ``index``: the rest of this pass, then the next pass (forward → recompute in
        reverse order → next forward), without repeats."""
        n = len(self._blocks)
        forward, backward = list(range(n)), list(range(n - 1, -1, -1))
        if recompute:
            order = backward[backward.index(index) + 1:] + forward
        else:
            order = forward[index + 1:] + backward
        out: list[int] = []
        for i in order:
            if i != index and i not in out:
                out.append(i)
        return out

    def _load(self, index: int, upcoming: Sequence[int]) -> _Slot:
        """Start copying block ``index`` into the free slot whose block is needed last (or not at all)."""
        free = [s for s in self._slots if not s.held]
        if not free:
            raise RuntimeError(f"weight streamer: every slot is in use when block {self._blocks[index].name} needs "
                               "one (blocks entered without leaving)")

        def need_rank(slot: _Slot) -> tuple[int, int]:
            if slot.block is None or slot.block not in upcoming:
                return (len(upcoming) + 1, -slot.last_use)
            return (upcoming.index(slot.block), -slot.last_use)

        slot = max(free, key=need_rank)
        block = self._blocks[index]
        slot.ready = self.transfers.upload(slot.buffer[:block.nbytes], block.host, slot.free_after)
        slot.block = index
        self.stats.uploads += 1
        self.stats.upload_bytes += block.nbytes
        return slot

    def _prefetch(self, index: int, recompute: bool) -> None:
        """Fill the other slots with the blocks needed next, nearest first."""
        upcoming = self._upcoming(index, recompute)[:len(self._slots) - 1]
        for position, nxt in enumerate(upcoming):
            if self._slot_of(nxt) is not None:
                continue
            free = [s for s in self._slots if not s.held
                    and (s.block is None or s.block not in upcoming[:position + 1])]
            if not free:
                return
            self._load(nxt, upcoming)

    def close(self) -> None:
        """Wait for every copy, point every tensor at its host copy, give the slots and the pinning back."""
        self.transfers.finish()
        for slot in self._slots:
            if slot.block is not None:
                block = self._blocks[slot.block]
                for t, view in zip(block.tensors, block.host_views):
                    t.data = view
            slot.block = None
        self._slots.clear()
        for block in self._blocks:
            self.transfers.free_host(block.host)
