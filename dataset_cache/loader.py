"""The prefetching loader: batches N+1..N+k are read while the consumer trains on batch N.

Threads, not processes: reads are coalesced ``preadv`` calls that release the GIL, so a thread or two keep up with
a GPU step, nothing is pickled, and it works the same on Windows and in a one-CPU container.

* The consumer's thread alone walks the sampler and submits up to ``prefetch_batches`` jobs ahead; each job owns
  its result slot, so batches come out in sampler order whatever the number of threads.
* Each job carries its read plan. A worker starting job N first plans and announces job N+1 (the plans are drawn
  one ahead, so every job knows its successor), so while reads come from the disk two batches are in flight.
* Host memory is bounded by ``(prefetch_batches + 1) x batch bytes``. CPU target: a batch is made of views of the
  buffer it was read into (:mod:`.batch_assembly`), and a buffer is reused only once nothing refers to its memory
  (:mod:`.buffer_pool`), so a batch you keep never changes. CUDA target (:mod:`.cuda_delivery`): one reused pinned
  buffer per worker, copies from pinned memory only, on ONE side stream, ordered against the consumer's stream with
  events and ``record_stream``.
* Loss masks (``BatchPlan.mask_keys``) are read in the batch's one read, travel as stored (one byte a cell) and
  become ``Batch.masks`` on the target device: float in [0, 1], mirrored rows flipped, ones for rows without a
  mask, the same bits on both targets; a mask not at its latent's size is named.
* ``per_batch``: a hook called on the worker after each read (e.g. the trainer's noise, drawn on the CPU); what it
  returns reaches the consumer as ``Batch.extras`` on the target device, off the training thread.
* A worker's exception reaches the consumer at the batch that failed, as :class:`LoaderWorkerError`.
* Threads start on first iteration and stop on :meth:`PrefetchLoader.close`, ``with``, garbage collection, or an
  abandoned iteration. The jobs and the worker threads themselves: :mod:`.loader_jobs`.

Not here: worker processes, decoding or augmenting images, and ComfyUI calls from worker threads (pass ``on_wait``
to run an interrupt check while the consumer waits). Design history: docs/ARCHITECTURE.md; figures:
docs/BENCHMARKS.md (L3, L4).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .batch_assembly import Batch, PerBatch, host_bytes
from .buffer_pool import BufferPool, Slot
from .constants import DEFAULT_PREFETCH_BATCHES
from .cuda_delivery import CudaDelivery, hand_over
from .errors import CacheError
from .loader_jobs import Context, Job, Upcoming, Workers, run_job
from .reading import BatchReader, PlannedReader
from .sampler import BatchPlan, BucketSampler
from .threads import available_cpus, resolve_threads

__all__ = ["Batch", "LoaderStats", "LoaderWorkerError", "PrefetchLoader"]

log = logging.getLogger("dataset_cache.loader")

_WAIT_POLL_S = 0.05
"""How often ``on_wait`` runs while the consumer waits: ComfyUI interrupts feel immediate below ~100 ms."""

_RECENT = 1024
"""Per-batch timings kept for :attr:`PrefetchLoader.stats` (bounded, so memory stays flat on long runs)."""


@dataclass(frozen=True)
class LoaderStats:
    """Timings of the batches delivered so far (a snapshot).

    Attributes:
        batches: batches delivered.
        read_s: seconds the workers spent reading and assembling those batches.
        wait_s: seconds the consumer spent blocked waiting for them.
        elapsed_s: seconds from each iteration's first request to its last delivery, summed.
        recent_read_s: per-batch read seconds of the last batches (at most 1024).
        recent_wait_s: per-batch wait seconds of the last batches (at most 1024).
        pageable_copies: CUDA target: tensors of batch reads that were not in pinned host memory when they were due
            to be copied to the device (each was first copied into pinned memory; a warning names the first). 0
            when the reader reads into the loader's pinned buffers, as ``CacheReader`` and ``MultiCacheReader`` do.
    """

    batches: int = 0
    read_s: float = 0.0
    wait_s: float = 0.0
    elapsed_s: float = 0.0
    recent_read_s: tuple[float, ...] = ()
    recent_wait_s: tuple[float, ...] = ()
    pageable_copies: int = 0

    @property
    def mean_read_s(self) -> float:
        """Mean read time of a batch."""
        return self.read_s / self.batches if self.batches else 0.0

    @property
    def wait_fraction(self) -> float:
        """Share of the consumer's time spent waiting for data (0 = reads fully hidden)."""
        return self.wait_s / self.elapsed_s if self.elapsed_s > 0 else 0.0


class LoaderWorkerError(CacheError, RuntimeError):
    """A loader thread failed to read or assemble a batch; the original exception is ``__cause__``.

    Attributes:
        plan: the batch that failed.
    """

    def __init__(self, message: str, plan: BatchPlan) -> None:
        super().__init__(message)
        self.plan = plan


def default_loader_threads(prefetch_batches: int) -> int:
    """Loader threads chosen when none are asked for: two reads in flight when the CPUs allow, leaving one CPU
    to the training thread; one otherwise."""
    return max(1, min(2, prefetch_batches, available_cpus() - 1))


class PrefetchLoader:
    """Iterate batches of a :class:`~dataset_cache.sampler.BucketSampler`, reading ahead in background threads.

    Iterating yields the sampler's remaining batches of ``epochs`` epochs, in order, and moves the sampler's
    position as each batch is delivered, so ``loader.state_dict()`` (the sampler's) always resumes on the batch
    after the one being trained. Use it as a context manager or call :meth:`close`.

    Args:
        reader: an open cache reader (a :class:`~dataset_cache.reading.BatchReader`; a
            :class:`~dataset_cache.reading.PlannedReader` such as ``CacheReader`` also gets the next batch announced).
        sampler: the batch order.
        prefetch_batches: batches read ahead of the one being consumed (0: read in the consumer's thread).
        threads: worker threads; default: 2 when ``prefetch_batches`` >= 2 and the process may use 3 or more CPUs
            (two reads in flight, one CPU left to the training thread), else 1. Clamped to ``prefetch_batches`` and
            to the CPUs this process may use.
        device: target device of the batches (default CPU).
        pin_memory: read into pinned host buffers; default: when ``device`` is CUDA. Needs a CUDA device.
        epochs: epochs one iteration spans (``None``: endless; stop with ``break``).
        on_wait: called in the consumer's thread every ~50 ms while it waits for data (e.g. ComfyUI's interrupt
            check); an exception it raises ends the iteration.
        per_batch: called on the worker thread after each batch's read with its number in the iteration, its plan
            and the latents' shape
            (``[B, ...]``); returns CPU tensors by name, which reach the consumer as ``Batch.extras`` on ``device``
            with the batch (pinned staging and the side stream on CUDA, the tensors themselves on the CPU). For
            per-step inputs such as the noise of a step: drawn off the training thread, never a blocking copy.
            It must be thread-safe, depend on its arguments alone (batches are read out of order), and not change
            a tensor after returning it.

    Raises:
        ValueError: bad arguments, or a CUDA device without CUDA.
    """

    def __init__(
        self,
        reader: BatchReader,
        sampler: BucketSampler,
        *,
        prefetch_batches: int = DEFAULT_PREFETCH_BATCHES,
        threads: int | None = None,
        device: str | torch.device | None = None,
        pin_memory: bool | None = None,
        epochs: int | None = 1,
        on_wait: Callable[[], None] | None = None,
        per_batch: PerBatch | None = None,
    ) -> None:
        if prefetch_batches < 0:
            raise ValueError(f"prefetch_batches must be >= 0, got {prefetch_batches}")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None (endless), got {epochs}")
        dev = torch.device(device if device is not None else "cpu")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {dev} requested but CUDA is not available; use device='cpu'")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        pin = dev.type == "cuda" if pin_memory is None else bool(pin_memory)
        if pin and dev.type != "cuda":
            raise ValueError(f"pin_memory=True needs a CUDA device (got device {dev}); leave pin_memory unset")
        self.reader = reader
        self.sampler = sampler
        self.epochs = epochs
        self.device = dev
        self.pin_memory = pin
        self.on_wait = on_wait
        self._depth = int(prefetch_batches)
        n_threads = 0
        if self._depth:
            wanted = default_loader_threads(self._depth) if threads is None else max(1, threads)
            if wanted > self._depth:
                log.warning("loader threads: %d requested but only %d batch(es) are read ahead; using %d",
                            wanted, self._depth, self._depth)
                wanted = self._depth
            n_threads = resolve_threads(wanted, purpose="loader threads", maximum=self._depth)
        cuda = CudaDelivery(dev) if dev.type == "cuda" else None  # its side stream lives as long as the loader
        pool = BufferPool(self._depth + 2) if dev.type == "cpu" else None
        planned = isinstance(reader, PlannedReader)
        self._ctx = Context(reader, dev, pin, [Slot() for _ in range(max(1, n_threads))], pool, cuda,
                             planned=planned, read_ahead=planned and n_threads > 0, per_batch=per_batch)
        self._workers = Workers(n_threads, self._ctx) if n_threads else None
        self._finalizer = weakref.finalize(self, Workers.stop, self._workers) if self._workers else None
        self._pending: deque[Job] = deque()
        self._generation = 0
        self._closed = False
        self._stats = LoaderStats()
        self._recent_read: deque[float] = deque(maxlen=_RECENT)
        self._recent_wait: deque[float] = deque(maxlen=_RECENT)
        self._warned_pageable = False

    @property
    def threads(self) -> int:
        """Worker threads in use (0 when ``prefetch_batches`` is 0)."""
        return self._workers.count if self._workers else 0

    @property
    def stats(self) -> LoaderStats:
        """Timings so far: per-batch read time, consumer wait time and the data-wait fraction."""
        return dataclasses.replace(self._stats, recent_read_s=tuple(self._recent_read),
                                   recent_wait_s=tuple(self._recent_wait))

    def held_bytes(self) -> int:
        """Host bytes the loader holds now: its read buffers (pinned, on CUDA, with their staging buffers), finished
        but undelivered CPU batches, and the kept CPU read buffers no batch uses (memory of delivered batches is the
        consumer's).

        At most ``(prefetch_batches + 1) × batch bytes`` (plus a read buffer's growth headroom).
        """
        total = sum(slot.nbytes() for slot in self._ctx.slots)
        if self._ctx.pool is not None:
            total += self._ctx.pool.unclaimed_nbytes()
        for job in list(self._pending):
            if job.done.is_set() and job.result is not None and self.device.type == "cpu":
                total += host_bytes(job.result)
        return total

    def reset_stats(self) -> None:
        """Forget the figures so far (e.g. after a warm-up)."""
        self._stats = LoaderStats()
        self._recent_read.clear()
        self._recent_wait.clear()

    def state_dict(self) -> dict[str, Any]:
        """The sampler's resume state at the batch after the last one delivered."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the sampler (see :meth:`BucketSampler.load_state_dict`) from the next iteration on; an unfinished
        iteration is superseded (it raises if resumed)."""
        self.sampler.load_state_dict(state)
        self._cancel_pending()
        self._generation += 1

    def __len__(self) -> int:
        """Batches one full iteration yields from an epoch's start (needs finite ``epochs``)."""
        if self.epochs is None:
            raise TypeError("an endless loader (epochs=None) has no length")
        return len(self.sampler) * self.epochs

    def __iter__(self) -> Iterator[Batch]:
        if self._closed:
            raise RuntimeError("PrefetchLoader is closed; create a new one to iterate again")
        self._cancel_pending()  # a new iteration takes over from an unfinished one
        self._generation += 1
        return self._iterate(self._generation)

    def _iterate(self, generation: int) -> Iterator[Batch]:
        plans = Upcoming(self.sampler.plans(epochs=self.epochs))
        finished = False
        t_mark = time.perf_counter()
        try:
            while True:
                if generation != self._generation or self._closed:
                    raise RuntimeError("this iteration was superseded by a newer iteration or by close()")
                if not self._pending:
                    self._fill(plans, self._depth + 1)
                    if not self._pending:
                        finished = True
                        return
                job = self._pending.popleft()
                batch = self._deliver(job)
                self.sampler.seek(job.plan.epoch, job.plan.index + 1)
                now = time.perf_counter()  # elapsed spans the consumer's step as well as the wait
                self._stats = _add_elapsed(self._stats, now - t_mark)
                t_mark = now
                # Top the queue up last, once this batch is in hand: the woken worker plans its read (Python,
                # under the GIL) and would slow down whatever next() still had to do. ``depth`` jobs ahead.
                self._fill(plans, self._depth)
                yield batch
        finally:
            if generation == self._generation:
                self._cancel_pending()
                if not finished and self._workers is not None:
                    self._workers.stop()  # abandoned (break / exception): no threads left behind

    def _fill(self, plans: Upcoming, depth: int) -> None:
        while len(self._pending) < depth:
            job = plans.take()
            if job is None:
                return
            if self.device.type == "cuda":
                job.consumer_event = torch.cuda.Event()
                job.consumer_event.record(torch.cuda.current_stream(self.device))
            self._pending.append(job)
            if self._workers is not None:
                self._workers.submit(job)

    def _deliver(self, job: Job) -> Batch:
        t0 = time.perf_counter()
        if self._workers is None:
            run_job(job, self._ctx, self._ctx.slots[0])
        elif not job.done.is_set():
            while True:
                if self.on_wait is not None:
                    self.on_wait()
                if job.done.wait(_WAIT_POLL_S):
                    break
        waited = time.perf_counter() - t0 if self._workers is not None else 0.0
        if job.cancelled:
            raise RuntimeError("the loader was closed while waiting for a batch")
        if job.error is not None:
            plan, exc = job.plan, job.error
            raise LoaderWorkerError(
                f"loader thread failed on batch {plan.index} of epoch {plan.epoch} (latent entries "
                f"{', '.join(plan.latent_keys[:3])}{', ...' if len(plan.latent_keys) > 3 else ''}): "
                f"{type(exc).__name__}: {exc}",
                plan,
            ) from exc
        pageable = 0
        if job.delivered is not None:  # CUDA: the consumer's stream waits for the copies, then owns the memory
            if job.delivered.done is not None:  # (None only for a CPU stand-in of the delivery, in tests)
                hand_over(job.delivered, torch.cuda.current_stream(self.device))
            pageable = job.delivered.pageable
            if pageable and not self._warned_pageable:
                self._warned_pageable = True
                log.warning("loader: %d tensor(s) of batch %d of epoch %d (first: entry %s) were not in pinned host "
                            "memory: staged through pinned memory before their copy (an extra host copy). The "
                            "reader did not read them into the loader's pinned buffer; counted in "
                            "LoaderStats.pageable_copies, warned once", pageable, job.plan.index, job.plan.epoch,
                            job.delivered.pageable_entry)
            job.delivered = None
        self._record(job.read_s, waited, pageable)
        batch, job.result = job.result, None  # the consumer alone decides how long the batch (and its buffer) lives
        return batch  # type: ignore[return-value]  # set whenever error is None

    def _record(self, read_s: float, wait_s: float, pageable: int) -> None:
        s = self._stats  # a new snapshot per batch, on the training thread: the constructor, not dataclasses.replace
        self._stats = LoaderStats(s.batches + 1, s.read_s + read_s, s.wait_s + wait_s, s.elapsed_s,
                                  pageable_copies=s.pageable_copies + pageable)
        self._recent_read.append(read_s)
        self._recent_wait.append(wait_s)

    def _cancel_pending(self) -> None:
        for job in self._pending:
            job.cancelled = True
        self._pending.clear()

    def close(self) -> None:
        """Stop and join every worker thread; idempotent. The reader is not closed (the loader does not own it)."""
        if self._closed:
            return
        self._closed = True
        self._cancel_pending()
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> PrefetchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _add_elapsed(s: LoaderStats, seconds: float) -> LoaderStats:
    return LoaderStats(s.batches, s.read_s, s.wait_s, s.elapsed_s + seconds, pageable_copies=s.pageable_copies)
