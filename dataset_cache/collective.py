"""What the ranks of a data-parallel run exchange, on ``torch.distributed``: the first adapter weights, the summed
gradients before each optimizer step, each step's loss and whether to stop.

Why not ``DistributedDataParallel``: it wraps one ``nn.Module`` whose forward it owns; the trainer's trainable
weights are ComfyUI's adapters patched into (or hooked onto) a model that ComfyUI loads, casts and calls itself, and
one all-reduce of the adapters' gradients before the optimizer step is all DDP would add (the trainer accumulates
``grad_accumulation_steps`` batches locally first, as DDP's ``no_sync`` would).

Every wait polls (``Work.is_completed``) instead of blocking inside the backend, so the process that started the
workers — ComfyUI's own — is never stuck in a collective whose peer has died: the ``check`` hook raises the
worker's error (:class:`~.workers.WorkerFailedError`) as soon as the worker pool notices, and the waits that may
last long (the first one, while every rank loads its model) also watch ``stop_requested`` (Cancel).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Collective", "RunStopped", "backend_for", "collective_timeout", "host_store", "join_store"]

log = logging.getLogger("dataset_cache.collective")

TIMEOUT_ENV = "STREAMCACHE_DDP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800.0
"""How long a collective may wait for a live but silent rank (a dead one is noticed at once): generous, because
the first one waits while every rank loads its model."""
RENDEZVOUS_TIMEOUT_S = 300.0
"""How long the ranks may take to meet after the workers reported that they start meeting."""
BUCKET_ELEMENTS = 1 << 24
"""Gradients are summed in fp32 buffers of at most 16 Mi elements (64 MiB): one all-reduce per bucket, a bounded
extra buffer however large the adapters are."""
_NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}
"""Set while rank 0's NCCL group is made: on a timeout NCCL's watchdog then aborts the communicators instead of
killing the process (the default, 3), and its heartbeat monitor never kills it either — rank 0 is ComfyUI."""


class RunStopped(RuntimeError):
    """Every rank agreed to stop at this step boundary (rank 0 was cancelled)."""


def backend_for(kind: str) -> str:
    """NCCL for CUDA devices where PyTorch has it (not on Windows), gloo otherwise (CPU ranks, Windows)."""
    if kind == "cuda" and dist.is_nccl_available() and sys.platform != "win32":
        return "nccl"
    return "gloo"


def collective_timeout() -> float:
    """Seconds a collective may wait: ``$STREAMCACHE_DDP_TIMEOUT_S`` or :data:`DEFAULT_TIMEOUT_S`."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


def host_store(world_size: int, timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's rendezvous store on ``127.0.0.1`` at a port the system picks (no port to guess, none to collide);
    its ``port`` goes to the workers."""
    return dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join_store(port: int, world_size: int, timeout_s: float = RENDEZVOUS_TIMEOUT_S, *,
               host: str = "127.0.0.1") -> dist.TCPStore:
    """A worker's client of rank 0's store (``host``: rank 0's machine, for a rank joining from another; the store
    listens on every interface of it)."""
    return dist.TCPStore(host, port, world_size, False, timeout=datetime.timedelta(seconds=timeout_s))


def _no_check(wait_s: float) -> None:
    return None


def _never() -> bool:
    return False


class Collective:
    """One rank's side of the run's process group.

    Args:
        rank, size: this rank and the number of ranks.
        device: the training device (gradients and losses live there).
        backend: ``"nccl"`` or ``"gloo"`` (gloo reduces on CPU copies).
        check: raises when the run must end because another rank failed; called while waiting, with how long it
            may wait for a failure to be reported (0 while polling; a few seconds after a collective failed).
        stop_requested: whether this rank wants to stop (rank 0: ComfyUI's interrupt flag).
        on_stop: called on every rank when the ranks agreed to stop, before :class:`RunStopped` is raised (rank 0
            raises ComfyUI's own interrupt exception there).
    """

    def __init__(self, rank: int, size: int, device: torch.device, backend: str, *,
                 check: Callable[[float], None] = _no_check, stop_requested: Callable[[], bool] = _never,
                 on_stop: Callable[[], None] | None = None) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self.backend = backend
        self.comm_device = device if backend == "nccl" else torch.device("cpu")
        self.check = check
        self.stop_requested = stop_requested
        self.on_stop = on_stop
        self.stopped = False
        """Whether the ranks agreed to stop (they all end by themselves then: no need to end them)."""

    # ------------------------------------------------------------------------------------------ the group
    def start(self, store: dist.Store, timeout_s: float) -> None:
        """Join the process group (every rank calls this with the same store); refuses a process that already
        has one (another extension's)."""
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process (by another extension?): "
                               "train on one device, or restart ComfyUI")
        env = _NCCL_ENV if self.backend == "nccl" and self.rank == 0 else {}
        with _environment(env):
            dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.size,
                                    timeout=datetime.timedelta(seconds=timeout_s))

    def close(self, *, failed: bool = False) -> None:
        """Leave the process group; after a failure NCCL's communicators are aborted first (destroying a group with
        an unfinished collective could wait for a peer that is gone)."""
        if not dist.is_initialized():
            return
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        try:
            if failed and self.backend == "nccl" and abort is not None:
                abort()
            else:
                dist.destroy_process_group()
        except Exception:  # the group is dead either way; a second run makes a new one
            log.debug("could not close the process group cleanly", exc_info=True)
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    # ------------------------------------------------------------------------------------------ exchanges
    def broadcast_(self, tensors: Sequence[torch.Tensor]) -> int:
        """Give every rank rank 0's values of ``tensors`` (in place); returns how many differed here before.

        The first exchange of a run: it waits while the ranks load their models, so it also watches Cancel.
        """
        differed = 0
        with torch.no_grad():
            for group in _by_dtype(tensors):  # half floats travel as fp32 (exact both ways; gloo lacks some)
                wire = torch.float32 if group[0].is_floating_point() and group[0].element_size() < 4 else None
                flat = torch.cat([t.detach().reshape(-1).to(self.comm_device, wire) for t in group])
                mine = flat.clone() if self.rank else flat
                self._wait(dist.broadcast(flat, 0, async_op=True), interruptible=True)
                if self.rank:
                    differed += _unflatten_into(flat, group, compare=mine)
        return differed

    def reduce_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Average the gradients of ``params`` over the ranks (in place), before the optimizer step.

        A parameter without a gradient on every rank keeps none (as one rank's optimizer would skip it); one with a
        gradient on some ranks only counts zeros for the others. Summed in fp32, divided by the number of ranks.
        """
        params = [p for p in params if p.requires_grad]
        if not params:
            return
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=self.comm_device)
        for start, chunk in _buckets(params, BUCKET_ELEMENTS):
            first = start == 0
            sizes = [p.numel() for p in chunk]
            head = len(params) if first else 0
            flat = torch.empty(head + sum(sizes), dtype=torch.float32, device=self.comm_device)
            if first:
                flat[:head] = present
            at = head
            for p, n in zip(chunk, sizes):
                if p.grad is None:
                    flat[at:at + n].zero_()
                else:
                    flat[at:at + n].copy_(p.grad.detach().reshape(-1))
                at += n
            self._wait(dist.all_reduce(flat, async_op=True))
            if first:
                present = flat[:head].clone()
            at = head
            for i, (p, n) in enumerate(zip(chunk, sizes), start):
                if present[i] > 0:
                    mean = (flat[at:at + n] / self.size).view_as(p)
                    p.grad = mean.to(p.grad.device if p.grad is not None else p.device,
                                     p.grad.dtype if p.grad is not None else p.dtype)
                at += n

    def agree(self, loss: float, *, stop: bool = False) -> float:
        """The step's loss averaged over the ranks; raises :class:`RunStopped` on every rank when any rank asked
        to stop (``stop``, or ``stop_requested``), after ``on_stop``. Called once per optimizer step by every rank,
        so all stop at the same step."""
        flag = 1.0 if stop or self.stop_requested() else 0.0
        t = torch.tensor([loss, flag], dtype=torch.float64, device=self.comm_device)
        self._wait(dist.all_reduce(t, async_op=True))
        mean, stops = (float(v) for v in t.cpu())
        if stops > 0:
            self.stopped = True
            if self.on_stop is not None:
                self.on_stop()
            raise RunStopped(f"rank {self.rank}: the run was stopped on another rank")
        return mean / self.size

    def extremes(self, values: Sequence[float]) -> tuple[list[float], list[float]]:
        """The element-wise minimum and maximum of ``values`` over the ranks (equal: every rank has the same)."""
        low = torch.tensor(list(values), dtype=torch.float64, device=self.comm_device)
        high = low.clone()
        self._wait(dist.all_reduce(low, op=dist.ReduceOp.MIN, async_op=True))
        self._wait(dist.all_reduce(high, op=dist.ReduceOp.MAX, async_op=True))
        return [float(v) for v in low.cpu()], [float(v) for v in high.cpu()]

    def sum_ints(self, values: Sequence[int]) -> list[int]:
        """``values`` summed element-wise over the ranks (end-of-run counts)."""
        t = torch.tensor(list(values), dtype=torch.int64, device=self.comm_device)
        self._wait(dist.all_reduce(t, async_op=True))
        return [int(v) for v in t.cpu()]

    # ------------------------------------------------------------------------------------------ waiting
    def _wait(self, work: Any, *, interruptible: bool = False) -> None:
        delay = 0.0
        while not work.is_completed():
            self.check(0.0)
            if interruptible and self.stop_requested():
                if self.on_stop is not None:
                    self.on_stop()
                raise RunStopped(f"rank {self.rank}: stopped while waiting for the other ranks")
            time.sleep(delay)
            delay = min(0.01, delay * 2 or 1e-4)
        try:
            work.wait()
        except Exception:
            self.check(5.0)  # a peer that died makes the collective fail: report the peer's own error
            raise


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor], *, compare: torch.Tensor) -> int:
    differed = 0
    at = 0
    for t in tensors:
        n = t.numel()
        part = flat[at:at + n]
        differed += int(not torch.equal(part, compare[at:at + n]))
        t.copy_(part.view_as(t).to(t.device))
        at += n
    return differed


def _buckets(params: Sequence[torch.Tensor], limit: int) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """Consecutive runs of ``params`` of at most ``limit`` elements (a larger tensor alone), with the index of
    each run's first parameter."""
    chunk: list[torch.Tensor] = []
    size = 0
    start = 0
    for i, p in enumerate(params):
        if chunk and size + p.numel() > limit:
            yield start, chunk
            start, chunk, size = i, [], 0
        chunk.append(p)
        size += p.numel()
    if chunk:
        yield start, chunk


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
