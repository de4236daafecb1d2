"""The prefetching loader: batches N+1..N+k are read while the consumer trains on batch N.

Threads, not processes: reads are coalesced ``preadv`` calls that release the GIL, so a thread or two keep up with
a GPU step, nothing is pickled, and it works the same on Windows and in a one-CPU container.

* The consumer's thread alone walks the sampler and submits up to ``prefetch_batches`` jobs ahead; each job owns
  its result slot, so batches come out in sampler order whatever the number of threads.
* Each job carries its read plan. A worker starting job N first plans and announces job N+1 (the plans are drawn
  one ahead, so every job knows its successor), so while reads come from the disk two batches are in flight.
* Host memory is bounded by ``(prefetch_batches + 1) x batch bytes``. CPU target: a batch is made of views of the
  buffer it was read into, and a buffer is reused only once nothing refers to its memory (``_BufferPool``), so a
  batch you keep never changes. CUDA target: one reused pinned buffer per worker, copies on ONE side stream,
  ordered against the consumer's stream with events and ``record_stream``.
* Loss masks (``BatchPlan.mask_keys``) are read in the batch's one read, travel as stored (one byte a cell, on
  CUDA from the pinned buffer on the side stream) and become ``Batch.masks`` on the target device: float in
  [0, 1], mirrored rows flipped, ones for rows without a mask; a mask not at its latent's size is named.
* A worker's exception reaches the consumer at the batch that failed, as :class:`LoaderWorkerError`.
* Threads start on first iteration and stop on :meth:`PrefetchLoader.close`, ``with``, garbage collection, or an
  abandoned iteration.

Not here: worker processes, decoding or augmenting images, and ComfyUI calls from worker threads (pass ``on_wait``
to run an interrupt check while the consumer waits). Design history: docs/ARCHITECTURE.md; figures:
docs/BENCHMARKS.md (L3, L4).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .constants import DEFAULT_PREFETCH_BATCHES
from .errors import CacheError
from .reading import BatchReader, PlannedReader
from .sampler import BatchPlan, BucketSampler
from .threads import available_cpus, resolve_threads

__all__ = ["Batch", "LoaderStats", "LoaderWorkerError", "PrefetchLoader"]

log = logging.getLogger("dataset_cache.loader")

_WAIT_POLL_S = 0.05
"""How often ``on_wait`` runs while the consumer waits: ComfyUI interrupts feel immediate below ~100 ms."""

_RECENT = 1024
"""Per-batch timings kept for :attr:`PrefetchLoader.stats` (bounded, so memory stays flat on long runs)."""


@dataclass
class Batch:
    """One batch, on the loader's device.

    Attributes:
        plan: which samples and entries it holds.
        latents: the stacked ``"samples"`` of every row, ``[B, C, H, W]`` (``[B, C, T, H, W]`` for video latents).
        conditioning: per row, its conditioning structure with real tensors (rows sharing a caption entry share the
            same objects; do not modify them in place).
        latent_extras: per row, the latent dict's other keys (e.g. ``"noise_mask"``), or ``None`` if no row has any.
        copy_events: CUDA only: timing events recorded on the loader's side stream before and after this batch's
            host-to-device copies (for profiling: ``start.elapsed_time(end)``); ``None`` on CPU.
        masks: the rows' loss masks, ``[B, 1, h, w]`` float32 in [0, 1] (1: full weight) at the latents' spatial
            size, a mirrored row's mask flipped with it, rows without a mask all ones; ``None`` when no row has one.
    """

    plan: BatchPlan
    latents: torch.Tensor
    conditioning: list[Any]
    latent_extras: list[dict[str, Any]] | None = None
    copy_events: tuple[Any, Any] | None = None
    masks: torch.Tensor | None = None


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
    """

    batches: int = 0
    read_s: float = 0.0
    wait_s: float = 0.0
    elapsed_s: float = 0.0
    recent_read_s: tuple[float, ...] = ()
    recent_wait_s: tuple[float, ...] = ()

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


@dataclass(eq=False)
class _Job:
    plan: BatchPlan
    consumer_event: Any = None  # torch.cuda.Event on the consumer's stream at submission (CUDA only)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    result: Batch | None = None
    device_tensors: list[torch.Tensor] = field(default_factory=list)
    copy_done: Any = None  # torch.cuda.Event recorded on the side stream after the copies
    error: BaseException | None = None
    read_s: float = 0.0
    started: bool = False
    successor: _Job | None = None  # the next job in batch order (drawn before it is submitted): announced at our start
    read_plan: Any = None  # the reader's plan of this read (PlannedReader), made by the first worker that needs it
    announced: bool = False  # the reader announced read_plan to the kernel ahead of the read


def _entry_keys(plan: BatchPlan) -> list[str]:
    """Every entry one batch reads, each once: latents, conditionings and loss masks in ONE read."""
    masks = tuple(k for k in plan.mask_keys if k is not None)
    return list(dict.fromkeys(plan.latent_keys + plan.caption_keys + masks))


def default_loader_threads(prefetch_batches: int) -> int:
    """Loader threads chosen when none are asked for: two reads in flight when the CPUs allow, leaving one CPU
    to the training thread; one otherwise."""
    return max(1, min(2, prefetch_batches, available_cpus() - 1))


class _Slot:
    """A worker's reusable read buffer and the copy that last read from it."""

    def __init__(self) -> None:
        self.buffer: Any = None
        self.copy_done: Any = None


@dataclass
class _Context:
    """What workers need; deliberately holds no reference to the loader, so an unclosed loader can be collected."""

    reader: Any  # a BatchReader, or a PlannedReader when `planned`
    device: torch.device
    pin: bool
    side_stream: Any
    slots: list[_Slot]
    pool: _BufferPool | None = None  # CPU target: reusable read buffers
    planned: bool = False  # the reader is a PlannedReader: jobs carry their plan, the next one is announced
    read_ahead: bool = False  # announce the next job's reads (only with worker threads)


def _new_buffer(pin: bool) -> Any:
    from .format.reader import ReadBuffer  # late: the loader module stays importable on its own

    return ReadBuffer(pin_memory=pin)


class _BufferPool:
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
            buf = _new_buffer(False)
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


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst`` (contiguous CPU tensors of equal size) with numpy: one thread, GIL released.

    ``torch``'s own copy would fan out to the intra-op thread pool, which the consumer's thread uses too; waking
    it on a busy machine cost far more than the copy (docs/ARCHITECTURE.md, the read path).
    """
    np.copyto(dst.view(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())


def _rows(plan: BatchPlan, values: dict[str, Any]) -> list[torch.Tensor]:
    rows = []
    for key in plan.latent_keys:
        v = values[key]
        if not isinstance(v, dict) or not isinstance(v.get("samples"), torch.Tensor):
            raise ValueError(f"latent entry {key} is not a latent dict with a 'samples' tensor")
        rows.append(v["samples"])
    kinds = {(tuple(r.shape[1:]), str(r.dtype)) for r in rows}
    if len(kinds) != 1:
        raise ValueError(
            f"batch {plan.index} of epoch {plan.epoch} mixes latent shapes/dtypes {sorted(kinds)}: the sampler's "
            "buckets do not match the latents; build buckets with buckets_from_reader()"
        )
    return rows


def _as_one_block(rows: list[torch.Tensor]) -> torch.Tensor | None:
    """``rows`` as one ``[B, ...]`` view when they already lie back to back, in order, in one storage (the
    reader places a batch's latents so); ``None`` otherwise."""
    first = rows[0]
    if not first.is_contiguous():
        return None
    n, start = first.numel(), first.storage_offset()
    ptr, shape = first.untyped_storage().data_ptr(), first.shape[1:]
    for i, r in enumerate(rows):
        if (r.storage_offset() != start + i * n or r.shape[0] != 1 or r.shape[1:] != shape
                or not r.is_contiguous() or r.untyped_storage().data_ptr() != ptr):
            return None
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return first.as_strided((len(rows), *shape), (n, *reversed(strides)), start)


def _stack(rows: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Stack latent rows into one ``[B, ...]`` tensor on ``device`` (async from pinned memory on CUDA).

    Rows that the reader left back to back need no stacking: on the CPU the batch is a view of its own read
    buffer, on CUDA one copy moves it.
    """
    block = _as_one_block(rows)
    if block is not None:
        return block.to(device, non_blocking=True) if device.type == "cuda" else block
    out = torch.empty((sum(r.shape[0] for r in rows), *rows[0].shape[1:]), dtype=rows[0].dtype, device=device)
    at = 0
    for r in rows:
        dst = out[at : at + r.shape[0]]
        if device.type == "cuda":
            dst.copy_(r, non_blocking=True)
        else:
            _copy_bytes(dst, r.contiguous())
        at += r.shape[0]
    return out


def _mask_rows(plan: BatchPlan, values: dict[str, Any], latents: torch.Tensor) -> list[torch.Tensor | None]:
    """Each row's stored ``uint8`` mask (``[1, 1, h, w]``, checked against its latent's size), ``None`` without."""
    h, w = latents.shape[-2:]
    out: list[torch.Tensor | None] = []
    for key, latent in zip(plan.mask_keys, plan.latent_keys):
        if key is None:
            out.append(None)
            continue
        value = values[key]
        mask = value.get("mask") if isinstance(value, dict) else None
        if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[:2] != (1, 1):
            raise ValueError(f"mask entry {key} is not a mask dict with a [1, 1, h, w] 'mask' tensor (got "
                             f"{type(mask).__name__ if not isinstance(mask, torch.Tensor) else list(mask.shape)}); "
                             "re-encode the dataset's masks")
        if tuple(mask.shape[-2:]) != (h, w):
            raise ValueError(f"mask entry {key} is {list(mask.shape[-2:])} but its latent {latent} is "
                             f"{[h, w]} (height, width): the mask was made for another crop or resolution; "
                             "re-encode the dataset's masks")
        out.append(mask)
    return out


def _masks(plan: BatchPlan, rows: list[torch.Tensor | None], device: torch.device, shape: torch.Size
           ) -> torch.Tensor:
    """``[B, 1, h, w]`` float32 loss masks on ``device``: stored bytes / 255, mirrored rows flipped, ones without.

    The bytes are gathered as they were read (on CUDA: copied from the pinned read buffer on the side stream, one
    byte a cell on the bus), then widened, scaled and flipped once for the whole batch on the target device."""
    gathered = torch.full((len(rows), 1, shape[-2], shape[-1]), 255, dtype=torch.uint8, device=device)
    for i, mask in enumerate(rows):
        if mask is None:
            continue
        if device.type == "cuda":
            gathered[i].copy_(mask[0], non_blocking=True)
        else:
            _copy_bytes(gathered[i], mask[0].contiguous())
    flipped = [i for i, (mask, flip) in enumerate(zip(rows, plan.mirrored)) if flip and mask is not None]
    if flipped:
        index = torch.tensor(flipped, device=device)
        gathered[index] = gathered[index].flip(-1)
    return gathered.to(torch.float32).div_(255.0)


def _assemble(job: _Job, ctx: _Context, values: dict[str, Any]) -> Batch:
    """Build the batch on the target device from the values of one batch read."""
    plan = job.plan
    latents = _stack(_rows(plan, values), ctx.device)
    if ctx.device.type == "cuda":
        job.device_tensors.append(latents)
        move = _cuda_mover(job, ctx.device)
    else:
        move = _keep  # CPU: the batch owns its read buffer; its tensors stay views of it
    if move is _keep:
        conds = values  # CPU: the values are the batch's own (views of its own read buffer)
    else:
        conds = {k: _map_tensors(values[k], move) for k in dict.fromkeys(plan.caption_keys)}
    extras = [{k: v for k, v in values[key].items() if k != "samples"} for key in plan.latent_keys]
    extras_out = ([e if move is _keep else _map_tensors(e, move) for e in extras] if any(extras) else None)
    masks = None
    if any(k is not None for k in plan.mask_keys):
        masks = _masks(plan, _mask_rows(plan, values, latents), ctx.device, latents.shape)
        if ctx.device.type == "cuda":
            job.device_tensors.append(masks)  # made on the side stream: the consumer's stream takes it over
    return Batch(plan, latents, [conds[k] for k in plan.caption_keys], extras_out, masks=masks)


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def _cuda_mover(job: _Job, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    def move(t: torch.Tensor) -> torch.Tensor:
        d = t.to(device, non_blocking=True)
        job.device_tensors.append(d)
        return d

    return move


def _run_job(job: _Job, ctx: _Context, slot: _Slot) -> None:
    """Read and assemble ``job`` into its result (or its error); runs in a worker, or inline without workers."""
    t0 = time.perf_counter()
    job.started = True
    try:
        reader = ctx.reader
        keys = _entry_keys(job.plan)
        nxt = job.successor
        if ctx.read_ahead and nxt is not None and not nxt.started and not nxt.cancelled:
            _announce(nxt, reader)  # its bytes come off the disk while this batch is read
        if slot.copy_done is not None:  # the previous batch's copy may still read this pinned buffer
            slot.copy_done.synchronize()
            slot.copy_done = None
        if slot.buffer is None and ctx.device.type == "cuda":
            slot.buffer = _new_buffer(ctx.pin)
        buffer = ctx.pool.take() if ctx.pool is not None else slot.buffer
        try:
            if ctx.planned:
                if job.read_plan is None:
                    job.read_plan = reader.plan(keys)
                got = reader.read_plan(job.read_plan, pin_memory=ctx.pin, out=buffer, announced=job.announced)
            else:
                got = reader.read(keys, pin_memory=ctx.pin, out=buffer)
        finally:
            if ctx.pool is not None:
                ctx.pool.give_back(buffer)  # from here on, the batch's views keep it from being taken again
        values = dict(zip(keys, got))
        if ctx.device.type == "cuda":
            with torch.cuda.device(ctx.device), torch.cuda.stream(ctx.side_stream):
                if job.consumer_event is not None:  # never overwrite memory the consumer's queued work still uses
                    ctx.side_stream.wait_event(job.consumer_event)
                start = torch.cuda.Event(enable_timing=True)
                start.record(ctx.side_stream)
                job.result = _assemble(job, ctx, values)
                job.copy_done = torch.cuda.Event(enable_timing=True)
                job.copy_done.record(ctx.side_stream)
                job.result.copy_events = (start, job.copy_done)
            slot.copy_done = job.copy_done
        else:
            job.result = _assemble(job, ctx, values)
    except BaseException as exc:  # handed to the consumer, re-raised there
        job.error = exc
    finally:
        job.read_s = time.perf_counter() - t0
        job.done.set()


def _announce(job: _Job, reader: PlannedReader) -> None:
    """Plan ``job``'s read (its worker reuses the plan) and announce it; never raises: the read reports errors."""
    try:
        plan = job.read_plan
        if plan is None:
            plan = job.read_plan = reader.plan(_entry_keys(job.plan))
        job.announced = reader.announce(plan)
    except (KeyError, ValueError, CacheError):  # an unknown key, a bad skeleton: job's own read names it
        return


class _Upcoming:
    """An iteration's plans as jobs, drawn one ahead, so that a job knows its successor before that one is
    submitted: a worker starting a job announces the successor's read (its bytes come off the disk meanwhile).
    Drawing a plan does not move the sampler (the loader moves it on delivery)."""

    def __init__(self, plans: Iterator[BatchPlan]) -> None:
        self._plans = plans
        self._next = self._draw()

    def _draw(self) -> _Job | None:
        plan = next(self._plans, None)
        return None if plan is None else _Job(plan)

    def take(self) -> _Job | None:
        """The next job (``None`` at the end), already linked to the one after it."""
        job = self._next
        if job is not None:
            self._next = job.successor = self._draw()
        return job


class _Workers:
    """The worker threads; restartable, and holding no reference to the loader."""

    def __init__(self, count: int, ctx: _Context) -> None:
        self.count = count
        self.ctx = ctx
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def submit(self, job: _Job) -> None:
        with self.lock:
            if not self.threads:
                self._start()
            self.jobs.put(job)

    def _start(self) -> None:
        self.stop_event = threading.Event()
        self.jobs = queue.SimpleQueue()
        for i in range(self.count):
            t = threading.Thread(
                target=_worker_main,
                args=(self.jobs, self.stop_event, self.ctx, self.ctx.slots[i]),
                name=f"dataset_cache-loader-{i}",
                daemon=True,  # never keeps the interpreter alive; close() joins them anyway
            )
            t.start()
            self.threads.append(t)

    def stop(self) -> None:
        """Cancel queued jobs and join every thread (a read in progress finishes first: no reads after this)."""
        with self.lock:
            threads, self.threads = self.threads, []
            self.stop_event.set()
            for _ in threads:
                self.jobs.put(None)
        me = threading.current_thread()
        for t in threads:
            if t is not me:
                t.join()
        while True:  # release anyone waiting on a job that will never run
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancelled = True
                job.done.set()


def _worker_main(jobs: queue.SimpleQueue, stop: threading.Event, ctx: _Context, slot: _Slot) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        if stop.is_set() or job.cancelled:
            job.cancelled = True
            job.done.set()
            if stop.is_set():
                return
            continue
        _run_job(job, ctx, slot)
        del job  # not while waiting for the next: a finished job's batch would keep its read buffer from the pool


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
        side = torch.cuda.Stream(dev) if dev.type == "cuda" else None  # ONE side stream for the loader's life
        pool = _BufferPool(self._depth + 2) if dev.type == "cpu" else None
        planned = isinstance(reader, PlannedReader)
        self._ctx = _Context(reader, dev, pin, side, [_Slot() for _ in range(max(1, n_threads))], pool,
                             planned=planned, read_ahead=planned and n_threads > 0)
        self._workers = _Workers(n_threads, self._ctx) if n_threads else None
        self._finalizer = weakref.finalize(self, _Workers.stop, self._workers) if self._workers else None
        self._pending: deque[_Job] = deque()
        self._generation = 0
        self._closed = False
        self._stats = LoaderStats()
        self._recent_read: deque[float] = deque(maxlen=_RECENT)
        self._recent_wait: deque[float] = deque(maxlen=_RECENT)

    @property
    def threads(self) -> int:
        """Worker threads in use (0 when ``prefetch_batches`` is 0)."""
        return self._workers.count if self._workers else 0

    @property
    def stats(self) -> LoaderStats:
        """Timings so far: per-batch read time, consumer wait time and the data-wait fraction."""
        s = self._stats
        return LoaderStats(s.batches, s.read_s, s.wait_s, s.elapsed_s, tuple(self._recent_read),
                           tuple(self._recent_wait))

    def held_bytes(self) -> int:
        """Host bytes the loader holds now: its read buffers (pinned, on CUDA), finished but undelivered CPU
        batches, and the kept CPU read buffers no batch uses (memory of delivered batches is the consumer's).

        At most ``(prefetch_batches + 1) × batch bytes`` (plus a read buffer's growth headroom).
        """
        total = sum(slot.buffer.tensor.numel() for slot in self._ctx.slots if slot.buffer is not None)
        if self._ctx.pool is not None:
            total += self._ctx.pool.unclaimed_nbytes()
        for job in list(self._pending):
            if job.done.is_set() and job.result is not None and self.device.type == "cpu":
                total += _host_bytes(job.result)
        return total

    def reset_stats(self) -> None:
        """Forget the timings so far (e.g. after a warm-up)."""
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
        plans = _Upcoming(self.sampler.plans(epochs=self.epochs))
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

    def _fill(self, plans: _Upcoming, depth: int) -> None:
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

    def _deliver(self, job: _Job) -> Batch:
        t0 = time.perf_counter()
        if self._workers is None:
            _run_job(job, self._ctx, self._ctx.slots[0])
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
        if job.copy_done is not None:  # CUDA: the consumer's stream waits for the copy, then owns the tensors
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(job.copy_done)
            for t in job.device_tensors:
                t.record_stream(stream)
        self._record(job.read_s, waited)
        batch, job.result = job.result, None  # the consumer alone decides how long the batch (and its buffer) lives
        return batch  # type: ignore[return-value]  # set whenever error is None

    def _record(self, read_s: float, wait_s: float) -> None:
        s = self._stats
        self._stats = LoaderStats(s.batches + 1, s.read_s + read_s, s.wait_s + wait_s, s.elapsed_s)
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


def _host_bytes(batch: Batch) -> int:
    seen: dict[int, int] = {}

    def visit(t: torch.Tensor) -> torch.Tensor:
        seen[t.data_ptr()] = t.numel() * t.element_size()
        return t

    _map_tensors([batch.latents, batch.conditioning, batch.latent_extras], visit)
    return sum(seen.values())


def _add_elapsed(s: LoaderStats, seconds: float) -> LoaderStats:
    return LoaderStats(s.batches, s.read_s, s.wait_s, s.elapsed_s + seconds)
