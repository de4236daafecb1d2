"""The CUDA target: a batch's host tensors copied to the device on the loader's side stream, from pinned memory only.

How one batch travels (on a worker thread, inside :meth:`CudaDelivery.deliver`):

* Its host tensors are grouped by the memory (storage) they are views of; each storage is checked ONCE to be pinned
  host memory. A pinned storage (the worker's read buffer, a ``MultiCacheReader``'s per-group buffer) moves in ONE
  copy of the bytes the batch uses, and every tensor becomes a view of that device block at the same offset: one
  copy and one allocation per storage instead of one per tensor, so little Python runs per batch. A tensor in
  pageable memory (a ``per_batch`` hook's, or a reader's value that is not a view of its buffer) is first copied
  into the worker's pinned staging buffer, so no copy ever reads pageable memory (that copy would wait for the side
  stream and block); a reader's such value is counted (``LoaderStats.pageable_copies``) and warned about once.
* Everything is queued on ONE side stream for the loader's life, after an event of the consumer's stream recorded
  when the job was submitted; the latents are stacked on the device when the reader did not lay them out as one
  block, and masks are gathered as bytes, flipped and widened there through the same table as on the CPU
  (:data:`~.batch_assembly.MASK_LUT`), so the values are the CPU path's bit for bit.
* A ``done`` event is recorded after the last of it. The consumer's stream waits on it and takes over every device
  allocation with ``record_stream`` (:func:`hand_over`); the worker writes its pinned buffers again only after
  ``done`` has completed (:class:`~.buffer_pool.Slot`). Temporaries freed on the worker stay on the side stream,
  whose later work is ordered after their use.

With ``device`` CPU (tests) the same steps run without streams or events, checking pinning with the given stand-in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .batch_assembly import (MASK_LUT, Batch, as_one_block, copy_bytes, map_tensors, mask_bytes, mask_rows,
                             reference_rows, widen_masks, with_references)
from .sampler import BatchPlan

__all__ = ["CudaDelivery", "Delivered", "hand_over"]

_ALIGN = 64  # device blocks and staged tensors start 64-byte aligned: a view of any dtype is aligned
_SPARSE_SLACK = 1 << 20  # a storage whose used span exceeds twice its tensors' bytes + this is copied per tensor


@dataclass
class Delivered:
    """One batch queued to the device: the batch, what the consumer's stream must take over, and when it is safe.

    Attributes:
        batch: the batch on the device (its tensors may still be being written on the side stream).
        allocations: every device allocation the batch's tensors are views of (each handed over once).
        done: CUDA event recorded on the side stream after the batch's last copy and kernel (``None`` on CPU).
        pageable: a reader's host tensors that were not in pinned memory (staged before their copy).
        pageable_entry: the entry of the first of them, for the warning.
    """

    batch: Batch
    allocations: list[torch.Tensor] = field(default_factory=list)
    done: Any = None
    pageable: int = 0
    pageable_entry: str | None = None


def hand_over(delivered: Delivered, stream: Any) -> None:
    """On the consumer's thread: make ``stream`` wait for the batch's copies, then own its device memory.

    ``record_stream`` keeps the caching allocator from giving a block back to the side stream before the work
    ``stream`` has queued on it when the consumer frees the batch has run."""
    stream.wait_event(delivered.done)
    for t in delivered.allocations:
        t.record_stream(stream)


def _storage_is_pinned(storage: torch.UntypedStorage) -> bool:
    return bool(storage.is_pinned())


def _collect(value: Any, out: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, out)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def _span(t: torch.Tensor) -> int:
    """Bytes from a (non-empty) tensor's first element to past its last."""
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


class _Block:
    """One device allocation and its typed views (a view of any dtype starts at a multiple of its size)."""

    __slots__ = ("data", "typed")

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.data = torch.empty(-(-nbytes // _ALIGN) * _ALIGN, dtype=torch.uint8, device=device)
        self.typed: dict[torch.dtype, torch.Tensor] = {}

    def view(self, dtype: torch.dtype, shape: torch.Size, stride: tuple[int, ...], byte_offset: int) -> torch.Tensor:
        typed = self.typed.get(dtype)
        if typed is None:
            typed = self.typed[dtype] = self.data.view(dtype)
        return typed.as_strided(shape, stride, byte_offset // typed.element_size())


class _Transfer:
    """One batch's host tensors, grouped by storage, moved to the device; ``view_of`` gives each one's device view."""

    def __init__(self, device: torch.device, is_pinned: Callable[[torch.UntypedStorage], bool]) -> None:
        self.device = device
        self.is_pinned = is_pinned
        self.groups: dict[int, list[Any]] = {}  # storage address -> [storage, first byte, end byte, tensors]
        self.seen: set[int] = set()  # ids of the tensors added
        self.counted: set[int] = set()  # ids of the tensors of the read (a pageable one is counted)
        self.entry_of: dict[int, str] = {}  # first tensor's id of each entry -> the entry (for the warning)
        self.device_of: dict[int, torch.Tensor] = {}
        self.allocations: list[torch.Tensor] = []
        self.pageable = 0
        self.pageable_entry: str | None = None

    def add(self, tensors: list[torch.Tensor], entry: str | None = None) -> None:
        """Note host tensors that move with the batch; ``entry``: they are a reader's value (counted if pageable)."""
        groups, seen = self.groups, self.seen
        for t in tensors:
            if id(t) in seen:  # one tensor in several places (a repeated entry): moved once
                continue
            seen.add(id(t))
            if t.device.type != "cpu":
                raise TypeError(f"a host tensor was expected, got one on {t.device} (entry {entry})")
            if entry is not None:
                self.counted.add(id(t))
                self.entry_of.setdefault(id(t), entry)
            if t.numel() == 0:
                continue
            storage = t.untyped_storage()
            address = storage.data_ptr()
            begin = t.data_ptr() - address
            end = begin + (t.nbytes if t.is_contiguous() else _span(t))
            group = groups.get(address)
            if group is None:
                groups[address] = [storage, begin, end, [t]]
            else:
                group[1] = min(group[1], begin)
                group[2] = max(group[2], end)
                group[3].append(t)

    def run(self, staging: Any) -> None:
        """Queue the copies (on the current stream): one per pinned storage, one for everything staged."""
        staged: list[torch.Tensor] = []
        for storage, begin, end, tensors in self.groups.values():
            if not self.is_pinned(storage):
                staged += tensors
                continue
            payload = sum(t.numel() * t.element_size() for t in tensors)
            if end - begin > 2 * payload + _SPARSE_SLACK:  # a few small views of a large pinned tensor
                for t in tensors:
                    self._copy_one(t)
                continue
            first = begin - begin % _ALIGN  # views keep their offsets' alignment: any dtype stays aligned
            host = torch.empty(0, dtype=torch.uint8).set_(storage)[first:end]
            block = _Block(end - first, self.device)
            block.data[: end - first].copy_(host, non_blocking=True)
            self.allocations.append(block.data)
            address = storage.data_ptr() + first
            for t in tensors:
                self.device_of[id(t)] = block.view(t.dtype, t.shape, t.stride(), t.data_ptr() - address)
        if staged:
            self._stage(staged, staging)

    def _copy_one(self, t: torch.Tensor) -> None:
        d = torch.empty_like(t, device=self.device)
        d.copy_(t, non_blocking=True)
        self.allocations.append(d)
        self.device_of[id(t)] = d

    def _stage(self, tensors: list[torch.Tensor], staging: Any) -> None:
        """Copy pageable tensors into the pinned staging buffer (numpy: GIL released), then to the device at once."""
        at, placed = 0, []
        for t in tensors:
            if id(t) in self.counted:
                self.pageable += 1
                if self.pageable_entry is None:
                    self.pageable_entry = self.entry_of.get(id(t))
            placed.append(at)
            at += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        host = staging.ensure(at)
        for t, pos in zip(tensors, placed):
            copy_bytes(host[pos : pos + t.numel() * t.element_size()], t.detach().contiguous())
        block = _Block(at, self.device)
        block.data[:at].copy_(host, non_blocking=True)
        self.allocations.append(block.data)
        for t, pos in zip(tensors, placed):
            self.device_of[id(t)] = block.view(t.dtype, t.shape, _contiguous_strides(t.shape), pos)

    def view_of(self, t: torch.Tensor) -> torch.Tensor:
        """The device tensor holding ``t``'s values (an empty one for an empty ``t``)."""
        d = self.device_of.get(id(t))
        if d is None:  # only empty tensors are never grouped
            d = self.device_of[id(t)] = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        return d


class CudaDelivery:
    """A loader's CUDA delivery: its side stream, the mask table on the device, and the per-batch copies.

    Args:
        device: the target device (CPU only in tests: the same steps, no streams).
        is_pinned: whether a host storage is pinned (default: torch's own check); tests pass a stand-in.
    """

    def __init__(self, device: torch.device, *,
                 is_pinned: Callable[[torch.UntypedStorage], bool] | None = None) -> None:
        self.device = device
        self.is_pinned = is_pinned or _storage_is_pinned
        self.side_stream: Any = None
        if device.type == "cuda":
            self.side_stream = torch.cuda.Stream(device)  # ONE side stream for the loader's life
            with torch.cuda.device(device), torch.cuda.stream(self.side_stream):
                self.lut = MASK_LUT.to(device)  # made on the side stream, the only one that reads it
        else:
            self.lut = MASK_LUT.clone()

    def _on_side_stream(self) -> contextlib.AbstractContextManager[Any]:
        if self.side_stream is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(self.side_stream))
        return stack

    def deliver(self, plan: BatchPlan, values: dict[str, Any], rows: list[torch.Tensor],
                extras: dict[str, torch.Tensor], staging: Any, after: Any = None) -> Delivered:
        """Queue one batch's copies and device work on the side stream (after the consumer event ``after``).

        ``values``: the batch read's values by entry; ``rows``: its latent rows; ``extras``: the ``per_batch``
        hook's CPU tensors; ``staging``: the worker's pinned staging buffer (free: its last copy has completed).
        """
        parts = _Parts(plan, values, rows, extras, _Transfer(self.device, self.is_pinned))
        with self._on_side_stream():
            start = done = None
            if self.side_stream is not None:
                if after is not None:  # never overwrite memory the consumer's queued work still uses
                    self.side_stream.wait_event(after)
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.side_stream)
            parts.transfer.run(staging)
            batch = parts.on_device(self.lut)
            if self.side_stream is not None:
                done = torch.cuda.Event(enable_timing=True)
                done.record(self.side_stream)
                batch.copy_events = (start, done)
        t = parts.transfer
        return Delivered(batch, t.allocations, done, t.pageable, t.pageable_entry)


class _Parts:
    """One batch's parts on the host, noted in ``transfer`` (each entry's tensors with the entry, for the count of
    pageable ones), then built again of device views once the transfer has run."""

    def __init__(self, plan: BatchPlan, values: dict[str, Any], rows: list[torch.Tensor],
                 extras: dict[str, torch.Tensor], transfer: _Transfer) -> None:
        self.plan, self.values, self.rows, self.extras, self.transfer = plan, values, rows, extras, transfer
        self.block = as_one_block(rows)  # the reader laid the latents out as one [B, ...] block: moved as one
        if self.block is None:
            for key, row in zip(plan.latent_keys, rows):
                transfer.add([row], key)
        else:
            transfer.add([self.block], plan.latent_keys[0])
        self.captions = list(dict.fromkeys(plan.caption_keys))
        for key in self.captions:
            self._add(values[key], key)
        self.latent_extras = [{k: v for k, v in values[key].items() if k != "samples"} for key in plan.latent_keys]
        for key, e in zip(plan.latent_keys, self.latent_extras):
            self._add(e, key)
        self.masks: list[torch.Tensor | None] | None = None
        if any(k is not None for k in plan.mask_keys):
            self.masks = mask_rows(plan, values, (rows[0].shape[-2], rows[0].shape[-1]))
            for mask_key, m in zip(plan.mask_keys, self.masks):
                if m is not None and mask_key is not None:
                    transfer.add([m], mask_key)
        self.references = reference_rows(plan, values) if plan.reference_keys else None
        for ref_key, ref in zip(plan.reference_keys, self.references or ()):
            if ref is not None and ref_key is not None:
                transfer.add([ref], ref_key)
        transfer.add(list(extras.values()))

    def _add(self, value: Any, entry: str) -> None:
        found: list[torch.Tensor] = []
        _collect(value, found)
        self.transfer.add(found, entry)

    def on_device(self, lut: torch.Tensor) -> Batch:
        """The batch of device views (latents stacked, masks widened through ``lut`` on the device if needed)."""
        plan, transfer = self.plan, self.transfer
        view = transfer.view_of
        if self.block is not None:
            latents = view(self.block)
        else:
            latents = torch.cat([view(r) for r in self.rows])
            transfer.allocations.append(latents)
        conds = {k: map_tensors(self.values[k], view) for k in self.captions}
        masks = None
        if self.masks is not None:
            hw = (latents.shape[-2], latents.shape[-1])
            gathered = mask_bytes(plan, [None if m is None else view(m) for m in self.masks], hw, latents.device)
            masks = widen_masks(gathered, lut)
            transfer.allocations.append(masks)
        latent_extras = [map_tensors(e, view) for e in self.latent_extras] if any(self.latent_extras) else None
        conditioning = [conds[k] for k in plan.caption_keys]
        if self.references is not None:
            conditioning = with_references(conditioning, [None if r is None else view(r) for r in self.references])
        return Batch(plan, latents, conditioning, latent_extras, masks=masks,
                     extras={k: view(t) for k, t in self.extras.items()})
