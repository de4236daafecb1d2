"""The loader's host buffers: the CPU target's pool of read buffers, and a CUDA worker's pinned slot.

A CPU batch is made of views of the buffer it was read into, so a CPU buffer returns to the pool only once nothing
refers to its memory. A CUDA batch is copied to the device, so each worker keeps ONE pinned read buffer (pinning is
costly) and one pinned staging buffer, reused once the copy that last read them has completed.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["BufferPool", "Slot", "new_buffer"]


def new_buffer(pin: bool) -> Any:
    """A new, empty ``ReadBuffer`` (pinned when ``pin`` and CUDA is available)."""
    from .format.reader import ReadBuffer  # late: the loader modules stay importable on their own

    return ReadBuffer(pin_memory=pin)


class Slot:
    """A CUDA worker's reusable pinned buffers and the copy that last read them.

    ``buffer`` receives the worker's batch reads; ``staging`` the host tensors that were not in pinned memory (a
    ``per_batch`` hook's, or a reader's value that is not a view of ``buffer``) before their copy to the device.
    Neither is written again before ``copy_done`` (the event recorded after that copy) has completed.
    """

    def __init__(self) -> None:
        self.buffer: Any = None
        self.staging: Any = None
        self.copy_done: Any = None

    def ready(self, pin: bool) -> None:
        """Wait for the copy that last read this slot's buffers (if any), and make the buffers on first use."""
        if self.copy_done is not None:
            self.copy_done.synchronize()
            self.copy_done = None
        if self.buffer is None:
            self.buffer = new_buffer(pin)
            self.staging = new_buffer(pin)

    def nbytes(self) -> int:
        """Host bytes the slot's buffers hold."""
        return sum(b.tensor.numel() for b in (self.buffer, self.staging) if b is not None)


class BufferPool:
    """CPU read buffers that a batch's memory returns to once nothing refers to it any more.

    A CPU batch is made of views of the buffer it was read into, so a buffer is taken again only when its
    storage has no user but the pool (torch's storage use count: every tensor, view or numpy array over the
    memory holds one). A consumer that keeps batches therefore never sees them change; the pool then reads into
    new buffers, which it does not keep. Reusing a buffer spares the page faults of a fresh one.

    At most ``limit`` buffers are kept: ``depth + 2``, for the ``depth`` batches read ahead, the batch being
    trained, and the one before it, which a consumer still holds while it asks for the next (``for i, batch in
    enumerate(loader)`` does). Those are the buffers that reading into fresh ones had alive at the same moment.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buffers: list[Any] = []
        self._lent: set[int] = set()  # buffers a worker is reading into (no views exist yet)
        self._lock = threading.Lock()

    def take(self) -> Any:
        """A buffer nobody uses (kept, or new), lent to the caller until :meth:`give_back`."""
        with self._lock:
            for buf in self.buffers:
                if id(buf) not in self._lent and not buf.in_use():
                    self._lent.add(id(buf))
                    return buf
            buf = new_buffer(False)
            if buf.TRACKS_USE and len(self.buffers) < self.limit:
                self.buffers.append(buf)
                self._lent.add(id(buf))
            return buf

    def give_back(self, buf: Any) -> None:
        """End the loan; the batch's views (if any) keep the buffer from being taken while they live."""
        with self._lock:
            self._lent.discard(id(buf))

    def unclaimed_nbytes(self) -> int:
        """Bytes of the kept buffers no batch uses (idle, or being read into)."""
        with self._lock:
            return sum(buf.tensor.numel() for buf in self.buffers
                       if id(buf) in self._lent or not buf.in_use())
