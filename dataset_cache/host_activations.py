"""Tensors a forward pass keeps for the backward pass, held in host memory instead of the device.

With every block its own gradient checkpoint, what a forward keeps is each block's inputs (torch's checkpoint
saves them through the saved-tensor hooks in force) and what the layers outside the blocks save; a block's own
activations are recomputed. Under :meth:`HostActivations.hooks` those tensors are copied to host memory as they are
saved (on the transfers' side stream, so the forward does not wait) and copied back when the backward pass
unpacks them. Weights and small tensors stay where they are: they are not the run's activations, and a copy of a
few kilobytes costs more than it saves. A tensor saved several times (a rotary table every block takes) is
copied once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import weakref

import torch

from .transfers import Transfers

__all__ = ["HostActivations", "MIN_OFFLOAD_BYTES"]

MIN_OFFLOAD_BYTES = 1 << 20
"""Tensors below 1 MiB stay on the device: they are not where the memory goes, and their copies cost latency."""


class _Kept:
    """A tensor left on the device (small, a weight, or already on the host)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class HostActivations:
    """Saved-tensor hooks that keep large saved activations in host memory; counts what they moved."""

    def __init__(self, transfers: Transfers, *, min_bytes: int = MIN_OFFLOAD_BYTES) -> None:
        self.transfers = transfers
        self.min_bytes = min_bytes
        self.offloaded_bytes = 0
        self.restored_bytes = 0

    @contextmanager
    def hooks(self) -> Iterator[None]:
        """Within this context, saved tensors go to host memory (one forward pass: copies are shared within it)."""
        seen: dict[int, tuple[Any, int, Any]] = {}  # id → (weak ref, version, handle): the same live tensor only

        def pack(tensor: torch.Tensor) -> Any:
            nbytes = tensor.numel() * tensor.element_size()
            if (nbytes < self.min_bytes or isinstance(tensor, torch.nn.Parameter)
                    or tensor.device != self.transfers.device or type(tensor) is not torch.Tensor):
                return _Kept(tensor)
            entry = seen.get(id(tensor))
            if entry is not None and entry[0]() is tensor and entry[1] == tensor._version:
                return entry[2]
            handle = self.transfers.offload(tensor)
            seen[id(tensor)] = (weakref.ref(tensor), tensor._version, handle)
            self.offloaded_bytes += nbytes
            return handle

        def unpack(handle: Any) -> torch.Tensor:
            if isinstance(handle, _Kept):
                return handle.tensor
            out = self.transfers.restore(handle)
            self.restored_bytes += out.numel() * out.element_size()
            return out

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
