"""The loader's jobs and worker threads: one job per batch, read and delivered by whichever worker takes it.

A job carries its batch plan, its reader plan (made once, by the worker announcing it or the one reading it) and its
result or error; the consumer's thread alone creates jobs, in sampler order (:class:`Upcoming` draws them one ahead
so each job knows its successor), and waits on each in turn. A worker reads the batch into its slot's buffer (or a
pooled one on the CPU), calls the ``per_batch`` hook, and hands the values to the CPU assembly or the CUDA
delivery. Nothing here refers to the loader itself, so an unclosed loader can be garbage collected.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .batch_assembly import Batch, PerBatch, assemble_cpu, batch_shape, check_extras, entry_keys, latent_rows
from .buffer_pool import BufferPool, Slot
from .cuda_delivery import CudaDelivery, Delivered
from .errors import CacheError
from .reading import PlannedReader
from .sampler import BatchPlan

__all__ = ["Job", "Context", "Upcoming", "Workers", "run_job"]


@dataclass(eq=False)
class Job:
    """One batch to read: its plan, its reader plan and announcement, and its result or error once ``done``."""

    plan: BatchPlan
    number: int = 0  # the batch's place in its iteration's sequence (0: the first delivered)
    consumer_event: Any = None  # torch.cuda.Event on the consumer's stream at submission (CUDA only)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    result: Batch | None = None
    delivered: Delivered | None = None  # CUDA: what the consumer's stream waits for and takes over
    error: BaseException | None = None
    read_s: float = 0.0
    started: bool = False
    successor: Job | None = None  # the next job in batch order (drawn before it is submitted): announced at our start
    read_plan: Any = None  # the reader's plan of this read (PlannedReader), made by the first worker that needs it
    announced: bool = False  # the reader announced read_plan to the kernel ahead of the read



@dataclass
class Context:
    """What workers need; deliberately holds no reference to the loader, so an unclosed loader can be collected."""

    reader: Any  # a BatchReader, or a PlannedReader when `planned`
    device: torch.device
    pin: bool
    slots: list[Slot]
    pool: BufferPool | None = None  # CPU target: reusable read buffers
    cuda: CudaDelivery | None = None  # CUDA target: side stream, pinned checks, device copies
    planned: bool = False  # the reader is a PlannedReader: jobs carry their plan, the next one is announced
    read_ahead: bool = False  # announce the next job's reads (only with worker threads)
    per_batch: PerBatch | None = None  # called after each read with the batch's number, plan and latents' shape


def run_job(job: Job, ctx: Context, slot: Slot) -> None:
    """Read and assemble ``job`` into its result (or its error); runs in a worker, or inline without workers."""
    t0 = time.perf_counter()
    job.started = True
    try:
        nxt = job.successor
        if ctx.read_ahead and nxt is not None and not nxt.started and not nxt.cancelled:
            _announce(nxt, ctx.reader)  # its bytes come off the disk while this batch is read
        values = _read(job, ctx, slot)
        plan = job.plan
        rows = latent_rows(plan, values)
        extras = check_extras(ctx.per_batch(job.number, plan, batch_shape(rows))) if ctx.per_batch is not None \
            else {}
        if ctx.cuda is not None:
            job.delivered = ctx.cuda.deliver(plan, values, rows, extras, slot.staging, job.consumer_event)
            job.result = job.delivered.batch
            slot.copy_done = job.delivered.done  # the slot's buffers are written again only once it completed
        else:
            job.result = assemble_cpu(plan, values, rows, extras)
    except BaseException as exc:  # handed to the consumer, re-raised there
        job.error = exc
    finally:
        job.read_s = time.perf_counter() - t0
        job.done.set()


def _read(job: Job, ctx: Context, slot: Slot) -> dict[str, Any]:
    """The values of the job's one read, by entry key: into a pooled buffer (CPU) or the slot's pinned one."""
    reader = ctx.reader
    keys = entry_keys(job.plan)
    if ctx.pool is None:
        slot.ready(ctx.pin)  # the previous batch's copy may still read the slot's pinned buffers
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
    return dict(zip(keys, got))


def _announce(job: Job, reader: PlannedReader) -> None:
    """Plan ``job``'s read (its worker reuses the plan) and announce it; never raises: the read reports errors."""
    try:
        plan = job.read_plan
        if plan is None:
            plan = job.read_plan = reader.plan(entry_keys(job.plan))
        job.announced = reader.announce(plan)
    except (KeyError, ValueError, CacheError):  # an unknown key, a bad skeleton: job's own read names it
        return


class Upcoming:
    """An iteration's plans as jobs, drawn one ahead, so that a job knows its successor before that one is
    submitted: a worker starting a job announces the successor's read (its bytes come off the disk meanwhile).
    Drawing a plan does not move the sampler (the loader moves it on delivery)."""

    def __init__(self, plans: Iterator[BatchPlan]) -> None:
        self._plans = plans
        self._drawn = 0
        self._next = self._draw()

    def _draw(self) -> Job | None:
        plan = next(self._plans, None)
        if plan is None:
            return None
        self._drawn += 1
        return Job(plan, number=self._drawn - 1)

    def take(self) -> Job | None:
        """The next job (``None`` at the end), already linked to the one after it."""
        job = self._next
        if job is not None:
            self._next = job.successor = self._draw()
        return job


class Workers:
    """The worker threads; restartable, and holding no reference to the loader."""

    def __init__(self, count: int, ctx: Context) -> None:
        self.count = count
        self.ctx = ctx
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def submit(self, job: Job) -> None:
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


def _worker_main(jobs: queue.SimpleQueue, stop: threading.Event, ctx: Context, slot: Slot) -> None:
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
        run_job(job, ctx, slot)
        del job  # not while waiting for the next: a finished job's batch would keep its read buffer from the pool
