"""A worker process's share of a run: join the ranks, rebuild the model, open the caches, train, report.

Runs in the process ``worker_entry.py`` prepared (ComfyUI's options and folders already those of rank 0's
ComfyUI), or ``join_entry.py`` on another machine (its own folders, where it first finds the model files and caches
rank 0 named, ``machines.py``). The training is :func:`~.run.train_lora` itself, with this rank's collective: the
same code path as rank 0's, batches of this rank's rows. Whatever happens is reported to rank 0 over the control
link (``done``, ``stopped``, or ``error`` with the traceback) before the process ends.
"""

from __future__ import annotations

import logging
import os
import pickle
import traceback
from collections.abc import Callable
from typing import Any

import torch

import comfy.model_management

from ...dataset_cache.collective import Collective, RunStopped, join_store
from ...dataset_cache.multi_reader import MultiCacheReader
from ...dataset_cache.reopen import reopen
from ...dataset_cache.workers import WorkerLink
from ..paths import remote_options
from .distributed import WorkerJob, cpu_threads
from .machines import (Elsewhere, check_same_code, existing_placed, local_model_paths, open_named, replace_paths,
                       software)
from .model_spec import rebuild
from .run import train_lora

__all__ = ["main"]

log = logging.getLogger("streamcache.train")


def main(link: WorkerLink, payload: bytes, host: str = "127.0.0.1") -> int:
    """Run the job in ``payload`` (a pickled :class:`~.distributed.WorkerJob`; ``host``: rank 0's machine);
    returns the exit code."""
    job: WorkerJob = pickle.loads(payload)
    logging.basicConfig(level=logging.INFO, format=f"[Train LoRA rank {job.rank}] %(levelname)s %(name)s: "
                        "%(message)s")
    device = comfy.model_management.get_torch_device()
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(job.size))
    collective = Collective(job.rank, job.size, device, job.backend)
    readers: list[Any] = []
    code = 1
    try:
        if job.backend == "nccl" and device.type != "cuda":  # a machine joining a GPU run without a GPU
            raise RuntimeError(f"rank 0 trains on CUDA GPUs (NCCL) and this rank's device is {device}: join from "
                               "a machine with a CUDA GPU (and without --cpu)")
        away = job.elsewhere
        locate = _found_here(away, readers) if away is not None else None  # before meeting: what lacks fails fast
        link.send("ready", software())
        collective.start(join_store(job.port, job.size, host=host), job.timeout_s)
        log.info("joined %d ranks on %s (pid %d)", job.size, device, os.getpid())
        model = rebuild(job.model, locate)
        if away is None:
            readers.extend(reopen(address) for address in job.caches)
        reader = readers[0] if len(readers) == 1 else MultiCacheReader(readers)
        with existing_placed(away.existing if away is not None else None):
            train_lora(model, reader, job.samples, job.settings, reg=job.reg, reg_name=job.reg_name,
                       world=collective)
        code = 0
        link.send("done")
    except RunStopped:
        code = 0
        link.send("stopped")
    except BaseException as exc:  # reported to rank 0, which names this rank in the node's error
        link.send("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
    finally:
        for reader in readers:
            reader.close()
        collective.close(failed=code != 0)
    return code


def _found_here(away: Elsewhere, readers: list[Any]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """On another machine: the same code as rank 0's, its model files and caches found in this one's folders (or
    buckets, into its own fetch folder), each opened cache appended to ``readers`` (the caller closes them);
    returns how the loader's arguments read here."""
    check_same_code(away.code)
    paths = local_model_paths(away.files)
    fetch_dir = remote_options().fetch_dir
    for cache in away.caches:
        readers.append(open_named(cache, fetch_dir))
    return lambda args: replace_paths(args, paths, away.folders)
