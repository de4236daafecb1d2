"""How bytes move between host and device for the weight streamer and the host-held activations: one interface, a
CUDA implementation (pinned host memory, one side stream, events) and a synchronous one for the CPU.

The CUDA rules are the loader's (``loader.py``), applied to weights: copies run on a side stream from pinned host
memory so they overlap the compute stream; the compute stream waits on an *event* (the GPU waits, not the CPU);
a device buffer written on the side stream is marked with ``record_stream`` so the caching allocator never hands
its memory out while a copy into it is pending; a device buffer is overwritten only after an event recorded when
the compute that read it was enqueued.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = ["CudaTransfers", "SyncTransfers", "Transfers", "transfers_for"]


class Transfers(Protocol):
    """Moves bytes for a :class:`~dataset_cache.weight_stream.WeightStreamer` and :class:`HostActivations`."""

    device: torch.device

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` host tensor for the whole run (pinned where that makes copies asynchronous)."""
        ...

    def free_host(self, buffer: torch.Tensor) -> None:
        """Give back what :meth:`host_buffer` took (unpin); the tensor itself stays readable."""
        ...

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` device tensor that :meth:`upload` writes into."""
        ...

    def upload(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Any:
        """Enqueue ``dst.copy_(src)`` to start once the compute marked by ``after`` (``None``: at once) is done;
        return a token that :meth:`wait` takes."""
        ...

    def wait(self, ready: Any) -> None:
        """Make the compute that comes next wait for the copy ``ready`` stands for."""
        ...

    def mark(self) -> Any:
        """A marker for the compute enqueued so far (what :meth:`upload` waits for before overwriting)."""
        ...

    def offload(self, tensor: torch.Tensor) -> Any:
        """Start copying ``tensor`` to host memory; return a handle for :meth:`restore`."""
        ...

    def restore(self, handle: Any) -> torch.Tensor:
        """The tensor an :meth:`offload` handle holds, back on the device (ordered after that copy)."""
        ...

    def finish(self) -> None:
        """Wait until every copy is done (before buffers are given back)."""
        ...


class SyncTransfers:
    """Copies that are done when they are issued: the CPU, and the stand-in device of the CPU tests.

    ``alloc(nbytes, where)`` makes every buffer (``where``: ``"host"`` or ``"device"``) and ``copy(dst, src)`` every
    copy, so a test can see each one; by default host buffers are CPU tensors and device buffers ``device``'s.
    """

    def __init__(self, device: torch.device | str = "cpu", *,
                 alloc: Callable[[int, str], torch.Tensor] | None = None,
                 copy: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        self.device = torch.device(device)
        self._alloc = alloc or self._plain
        self._copy = copy or _copy

    def _plain(self, nbytes: int, where: str) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu" if where == "host" else self.device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return self._alloc(nbytes, "host")

    def free_host(self, buffer: torch.Tensor) -> None:
        return None

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        return self._alloc(nbytes, "device")

    def upload(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Any:
        self._copy(dst, src)
        return None

    def wait(self, ready: Any) -> None:
        return None

    def mark(self) -> Any:
        return None

    def offload(self, tensor: torch.Tensor) -> Any:
        host = torch.empty_like(tensor, device="cpu")
        self._copy(host, tensor)
        return host

    def restore(self, handle: Any) -> torch.Tensor:
        out = torch.empty_like(handle, device=self.device)
        self._copy(out, handle)
        return out

    def finish(self) -> None:
        return None


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


class CudaTransfers:
    """CUDA copies on one side stream from pinned host memory, ordered with the compute stream by events.

    ``pin(tensor) -> bool`` / ``unpin(tensor)`` register an ordinary host tensor as pinned (ComfyUI's
    ``pin_memory``/``unpin_memory``, which keep its budget of pinned RAM); without them host buffers come from
    torch's pinned allocator. A buffer that could not be pinned still works: its copies are then synchronous.
    """

    def __init__(self, device: torch.device | str, *, pin: Callable[[torch.Tensor], bool] | None = None,
                 unpin: Callable[[torch.Tensor], Any] | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaTransfers needs a CUDA device, got {self.device}")
        self.stream = torch.cuda.Stream(device=self.device)
        self._pin, self._unpin = pin, unpin
        self._registered: set[int] = set()

    def _current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        if self._pin is None:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes and self._pin(buffer):
            self._registered.add(buffer.data_ptr())
        return buffer

    def free_host(self, buffer: torch.Tensor) -> None:
        if self._unpin is not None and buffer.data_ptr() in self._registered:
            self._registered.discard(buffer.data_ptr())
            self._unpin(buffer)

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        buffer.record_stream(self.stream)  # written on the side stream: freed only after those copies
        return buffer

    def upload(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Any:
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)  # the compute that read dst's previous block is done
            dst.copy_(src, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return ready

    def wait(self, ready: Any) -> None:
        if ready is not None:
            self._current().wait_event(ready)

    def mark(self) -> Any:
        event = torch.cuda.Event()
        event.record(self._current())
        return event

    def offload(self, tensor: torch.Tensor) -> Any:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.stream.wait_stream(self._current())  # the tensor's producer is done before it is read
        with torch.cuda.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        tensor.record_stream(self.stream)  # its memory is not reused until the copy has read it
        return host, done

    def restore(self, handle: Any) -> torch.Tensor:
        host, done = handle
        self._current().wait_event(done)
        return host.to(self.device, non_blocking=True)

    def finish(self) -> None:
        self.stream.synchronize()
        torch.cuda.synchronize(self.device)


def transfers_for(device: torch.device, *, pin: Callable[[torch.Tensor], bool] | None = None,
                  unpin: Callable[[torch.Tensor], Any] | None = None) -> Transfers:
    """:class:`CudaTransfers` for a CUDA device, :class:`SyncTransfers` for any other."""
    if device.type == "cuda":
        return CudaTransfers(device, pin=pin, unpin=unpin)
    return SyncTransfers(device)
