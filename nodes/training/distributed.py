"""Train LoRA on several devices: rank 0 is ComfyUI's own process, one worker process per further device.

:func:`plan_team` reads the ``devices`` setting (one device: the run is exactly the one-process run, nothing is
started). :meth:`Team.started` checks that the model and the caches can reach the workers (before any process
starts), starts the workers from ``worker_entry.py`` (a fresh interpreter each: never ComfyUI's ``main.py``),
hands each its job, waits until they are about to meet, and makes the process group; whatever ends the run — the
end, an error, Cancel, a dead worker — it ends every worker and waits for it. The rest of the run is the
one-process trainer with a :class:`~dataset_cache.collective.Collective`: the sampler's rows of global batches,
gradients averaged before each optimizer step, the loss averaged, a stop agreed at a step boundary, the adapters'
first weights taken from rank 0, and rank 0's LoRA returned. docs/ARCHITECTURE.md ("Training on several devices")
has the reasons.

``+ N remote`` ranks are not started here: rank 0 listens at ``$STREAMCACHE_JOIN_ADDRESS`` for N join processes
started on other machines (``join_entry.py``) that know ``$STREAMCACHE_JOIN_KEY``, and sends each the job with what
it needs to find the model files and caches in its own folders (``machines.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import comfy.cli_args
import comfy.model_management
import folder_paths

from ...dataset_cache.collective import Collective, backend_for, collective_timeout, host_store
from ...dataset_cache.devices import AUTO, DevicePlan, parse_devices
from ...dataset_cache.reopen import CacheAddress, addresses_of, parts_of
from ...dataset_cache.workers import GRACE_S, START_TIMEOUT_S, WorkerPool
from .machines import Elsewhere, elsewhere, existing_lora, software, software_notes
from .model_spec import build_spec, recipe_args
from .report import RowCounts
from .settings import TrainSettings

__all__ = ["COMFYUI_ENV", "JOIN_ADDRESS_ENV", "JOIN_KEY_ENV", "JOIN_TIMEOUT_ENV", "PACK_ENV", "PACK_MODULE_ENV",
           "JoinSettings", "Team", "WorkerJob", "join_settings", "plan_team", "reader_addresses"]

log = logging.getLogger("streamcache.train")

ENTRY = Path(__file__).with_name("worker_entry.py")
"""The script a worker runs (by path: ComfyUI's ``main.py`` is never run again in a worker)."""
COMFYUI_ENV = "STREAMCACHE_COMFYUI"
PACK_ENV = "STREAMCACHE_PACK"
PACK_MODULE_ENV = "STREAMCACHE_PACK_MODULE"
_PACK_MODULE = __name__.rsplit(".nodes.training.", 1)[0]
"""The name ComfyUI imported this pack under (a worker imports it under the same name, so pickles resolve)."""
_PACK_ROOT = Path(__file__).resolve().parents[2]
JOIN_ADDRESS_ENV = "STREAMCACHE_JOIN_ADDRESS"
JOIN_KEY_ENV = "STREAMCACHE_JOIN_KEY"
JOIN_TIMEOUT_ENV = "STREAMCACHE_JOIN_TIMEOUT_S"
DEFAULT_JOIN_PORT = 29440
MIN_KEY_CHARS = 16


@dataclass(frozen=True)
class JoinSettings:
    """Where rank 0 waits for ranks from other machines, with which key, for how long."""

    host: str
    port: int
    key: bytes
    timeout_s: float


def join_settings(environ: Mapping[str, str] = os.environ) -> JoinSettings:
    """Read ``$STREAMCACHE_JOIN_ADDRESS`` (``host:port`` or ``port``; every interface at port 29440 by default),
    ``$STREAMCACHE_JOIN_KEY`` (required: at least 16 characters, the same on every machine) and
    ``$STREAMCACHE_JOIN_TIMEOUT_S`` (how long to wait for them; 600 s).

    Raises:
        ValueError: a missing or short key, a malformed address or timeout, naming the variable.
    """
    key = environ.get(JOIN_KEY_ENV, "")
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(f"devices '+ N remote': set {JOIN_KEY_ENV} to the same secret of at least {MIN_KEY_CHARS} "
                         "characters in the environment of this ComfyUI and of the join command on every other "
                         "machine (a process that does not know it cannot join the run)")
    raw = environ.get(JOIN_ADDRESS_ENV, "").strip() or str(DEFAULT_JOIN_PORT)
    host, _, port_text = raw.rpartition(":")
    try:
        port = int(port_text)
        if not 0 <= port <= 65535:
            raise ValueError
    except ValueError:
        raise ValueError(f"{JOIN_ADDRESS_ENV}={raw!r}: write host:port or a port, e.g. 0.0.0.0:{DEFAULT_JOIN_PORT}") \
            from None
    raw_timeout = environ.get(JOIN_TIMEOUT_ENV, "")
    try:
        timeout_s = float(raw_timeout) if raw_timeout else START_TIMEOUT_S
        if not timeout_s > 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{JOIN_TIMEOUT_ENV}={raw_timeout!r}: write a positive number of seconds") from None
    if ":" in host:  # multiprocessing's listener is IPv4 only
        raise ValueError(f"{JOIN_ADDRESS_ENV}={raw!r}: IPv6 addresses are not supported; give an IPv4 address or a "
                         "host name")
    return JoinSettings(host or "0.0.0.0", port, key.encode(), timeout_s)


@dataclass(frozen=True)
class WorkerJob:
    """Everything a worker needs for its share of the run (pickled to it after its ComfyUI is configured)."""

    rank: int
    size: int
    backend: str
    port: int
    timeout_s: float
    model: bytes
    caches: tuple[CacheAddress, ...]
    samples: Any
    reg: Any
    reg_name: str
    settings: TrainSettings
    elsewhere: Elsewhere | None = None
    """For a rank on another machine: how it finds the model files and caches there (``None``: a local worker)."""


def reader_addresses(reader: Any) -> tuple[CacheAddress, ...]:
    """How a worker opens what ``reader`` reads (:func:`~dataset_cache.reopen.addresses_of`).

    Raises:
        ValueError: a reader a worker could not open again, naming it and what to do.
    """
    try:
        return addresses_of(reader)
    except ValueError as exc:
        raise ValueError(f"training on several devices: {exc}; train on one device (devices '0')") from None


def _home(model: Any) -> torch.device:
    device = torch.device(getattr(model, "load_device", None) or comfy.model_management.get_torch_device())
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def plan_team(devices: str | Sequence[int] | None, model: Any, reader: Any = None,
              world: Collective | None = None) -> Team:
    """The ranks of a run: ``world`` given (a worker's own), else from ``devices`` (see
    :func:`~dataset_cache.devices.parse_devices`; ``None``: one device) with rank 0 on the model's device.

    Whether the model and the caches can reach worker processes is checked here, before anything starts. A list of
    devices that cannot be used that way is refused, naming why; ``auto`` trains on one device instead and says so
    (:attr:`Team.notes`): a workflow that trained on one GPU keeps training on a machine with several.
    """
    if world is not None:
        return Team(None, world)
    if devices is None:
        return Team(None)
    home = _home(model)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    plan = parse_devices(devices, home=home.type, home_index=home.index, cuda_count=count)
    if plan.size == 1:
        return Team(None)
    try:
        spec, caches = build_spec(model), reader_addresses(reader)
    except ValueError as exc:
        if not (isinstance(devices, str) and devices.strip().lower() in ("", AUTO)):
            raise
        note = f"devices 'auto' trained on one device, not on {plan.describe()}: {exc}"
        log.warning("Train LoRA: %s", note)
        return Team(None, notes=[note])
    if not plan.remote:
        return Team(plan, spec=spec, caches=caches)
    joining = join_settings()
    try:
        away = elsewhere(recipe_args(model), zip(caches, parts_of(reader)))
    except ValueError as exc:
        raise ValueError(f"training with ranks on other machines: {exc}") from None
    return Team(plan, spec=spec, caches=caches, joining=joining, away=away)


class Team:
    """This process's place in the run: rank, number of ranks, and (several ranks) the collective.

    Rank 0 makes it with a :class:`~dataset_cache.devices.DevicePlan` and starts the others in :meth:`started`;
    a worker makes it around its own collective.
    """

    def __init__(self, plan: DevicePlan | None, collective: Collective | None = None, *, spec: bytes = b"",
                 caches: tuple[CacheAddress, ...] = (), notes: Sequence[str] = (), joining: JoinSettings | None = None,
                 away: Elsewhere | None = None) -> None:
        self.plan = plan
        self.collective = collective
        self.spec = spec
        self.caches = caches
        self.joining = joining
        self.away = away
        """What ranks on other machines need to find the model files and caches there."""
        self.joined: dict[int, str] = {}
        """Rank → machine of each rank that joined from another machine (for the summary)."""
        self.joined_notes: list[str] = []
        """What the user must know of the ranks that joined (their software is not rank 0's), for the summary."""
        self.notes = list(notes)
        """What the run had to change (``auto`` on one device), for the node's summary."""
        self.pool: WorkerPool | None = None

    @property
    def rank(self) -> int:
        return self.collective.rank if self.collective is not None else 0

    @property
    def size(self) -> int:
        if self.collective is not None:
            return self.collective.size
        return self.plan.size if self.plan is not None else 1

    @contextlib.contextmanager
    def started(self, model: Any, samples: Any, settings: TrainSettings, reg: Any, reg_name: str) -> Iterator[Team]:
        """Rank 0 of several: start the workers and the process group for the body, end them after it, whatever
        happens. Otherwise nothing."""
        plan = self.plan
        if plan is None or self.collective is not None:
            yield self
            return
        backend = backend_for(plan.kind)
        timeout_s = collective_timeout()
        store = host_store(plan.size)
        joining = self.joining
        remote = range(plan.local, plan.size)
        pool = WorkerPool(ENTRY, range(1, plan.local), lambda rank: _worker_env(plan, rank), remote=remote,
                          **({"address": (joining.host, joining.port), "key": joining.key} if joining else {}))
        interrupted = comfy.model_management.processing_interrupted
        collective = Collective(0, plan.size, _home(model), backend, check=pool.check, stop_requested=interrupted,
                                on_stop=_interrupted)
        bootstrap = _bootstrap()
        away = self.away
        if away is not None:  # a rank on another machine continues rank 0's existing LoRA, sent with its job
            away = dataclasses.replace(away, existing=existing_lora(settings.existing_lora))

        def job(rank: int) -> bytes:  # pickled as each rank connects: one job's bytes held at a time
            return pickle.dumps(WorkerJob(rank, plan.size, backend, store.port, timeout_s, self.spec, self.caches,
                                          samples, reg, reg_name, settings, away if rank in remote else None),
                                protocol=pickle.HIGHEST_PROTOCOL)

        log.info("Train LoRA: %d ranks on %s (%s)", plan.size, plan.describe(), backend)
        finished = False
        self.pool = pool
        threads = torch.get_num_threads()
        if plan.kind == "cpu":  # CPU ranks share the cores rather than each taking them all
            torch.set_num_threads(cpu_threads(plan.size))
        try:
            pool.start(lambda rank: (bootstrap, job(rank)))
            pool.wait_ready(interrupted, _interrupted, *([joining.timeout_s] if joining else []))
            away = None  # every job is sent: an existing LoRA's bytes are not held through the run
            self.joined = pool.machines
            self.joined_notes = software_notes(software(), pool.about, self.joined)
            for note in self.joined_notes:
                log.warning("Train LoRA: %s", note)
            collective.start(store, timeout_s)
            self.collective = collective
            try:
                yield self
            except BaseException:
                if collective.stopped:  # Cancel agreed by every rank: the workers are ending by themselves
                    with contextlib.suppress(Exception):
                        pool.finish(timeout_s=GRACE_S)
                raise
            pool.finish()
            finished = True
        finally:
            torch.set_num_threads(threads)
            pool.close()
            collective.close(failed=not finished)
            self.collective = None
            self.pool = None

    def same_adapters(self, lora_sd: Mapping[str, torch.Tensor]) -> None:
        """Every rank starts from rank 0's adapter weights (the seed makes them equal already on ranks whose
        random numbers agree; this makes sure, and says so when they did not)."""
        if self.collective is None:
            return
        differed = self.collective.broadcast_([lora_sd[k] for k in sorted(lora_sd)])
        if differed:
            log.warning("Train LoRA rank %d: %d initial adapter tensors differed from rank 0's (other random "
                        "numbers on this device); rank 0's are used", self.rank, differed)

    def describe(self, batch_size: int) -> str | None:
        """Where the run trained, for the summary (``None``: one device, as always)."""
        if self.plan is None or self.plan.size == 1:
            return None
        where = f"{self.plan.size} ranks: {self.plan.describe()}"
        if self.joined:
            where += f" ({', '.join(f'rank {r} on {m}' for r, m in self.joined.items())})"
        return f"trained on {where}; global batch {batch_size * self.plan.size} ({batch_size} per rank)"

    @property
    def is_main(self) -> bool:
        """Whether this process is rank 0 (the one whose LoRA is the run's, and that saves what outlives it)."""
        return self.collective is None or self.collective.rank == 0

    def same_start(self, steps: int, first_batch: int, position: tuple[int, int], optimizer: Any) -> None:
        """Refuse to train when the ranks did not restore the same training state (a worker that did not find the
        state file rank 0 found would train with another optimizer state and drift away from rank 0).

        Raises:
            RuntimeError: naming what differs.
        """
        if self.collective is None:
            return
        checksum = sum(float(t.detach().double().sum()) for s in optimizer.state.values() for t in s.values()
                       if isinstance(t, torch.Tensor))
        names = ("steps", "first batch", "epoch", "batch", "optimizer state checksum")
        mine = [float(steps), float(first_batch), float(position[0]), float(position[1]), checksum]
        low, high = self.collective.extremes(mine)
        differ = [n for n, a, b in zip(names, low, high) if a != b]
        if differ:
            raise RuntimeError(f"the ranks do not continue from the same training state ({', '.join(differ)} "
                               f"differ; rank {self.rank} has {dict(zip(names, mine))}): a worker did not find "
                               "what rank 0 found (the existing LoRA or its training state); check that every "
                               "process sees the same ComfyUI folders, or train on one device")

    def total(self, counts: RowCounts) -> RowCounts:
        """The run's row counts over every rank (each rank counted its own rows)."""
        if self.collective is None:
            return counts
        names = ("trained", "dropped", "mirrored", "masked", "regularization", "referenced")
        summed = self.collective.sum_ints([getattr(counts, n) for n in names])
        return dataclasses.replace(counts, **dict(zip(names, summed)))


def _interrupted() -> None:
    """Rank 0's side of an agreed stop: ComfyUI's own interrupt, so the node ends "interrupted", not failed (the
    flag may already be cleared: ComfyUI's op that saw it raised and cleared it)."""
    comfy.model_management.interrupt_current_processing(False)
    raise comfy.model_management.InterruptProcessingException()


def cpu_threads(ranks: int) -> int:
    """Threads of each of ``ranks`` CPU ranks (``cpu:N``): the cores shared out."""
    return max(1, (os.cpu_count() or 1) // ranks)


def _worker_env(plan: DevicePlan, rank: int) -> dict[str, str]:
    env = {COMFYUI_ENV: str(Path(folder_paths.__file__).resolve().parent), PACK_ENV: str(_PACK_ROOT),
           PACK_MODULE_ENV: _PACK_MODULE, "PYTHONUNBUFFERED": "1"}
    if plan.kind == "cuda":  # the worker sees its one device, as cuda:0 (both variables, as --cuda-device sets)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [v.strip() for v in visible.split(",")] if visible else None
        index = plan.indices[rank]
        env["CUDA_VISIBLE_DEVICES"] = ids[index] if ids and index < len(ids) else str(index)
        if "HIP_VISIBLE_DEVICES" in os.environ:
            env["HIP_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"]
    return env


def _bootstrap() -> bytes:
    """ComfyUI's settings, for a worker to set before it imports ComfyUI's model code: the command-line options
    (dtypes, memory modes, ``--cpu``), the model folders (``existing_lora`` is found by name) and the output folder
    (where the training state of an existing LoRA is); and the name this pack is imported under (a rank on another
    machine imports it under the same one, so the job's pickles resolve)."""
    args = dict(vars(comfy.cli_args.args))
    args.update(cuda_device=None, default_device=None)  # the worker's one device is chosen by its environment
    folders = {name: (list(paths), set(exts)) for name, (paths, exts) in folder_paths.folder_names_and_paths.items()}
    places = {"output": folder_paths.get_output_directory(), "input": folder_paths.get_input_directory(),
              "temp": folder_paths.get_temp_directory()}
    return pickle.dumps({"args": args, "folders": folders, "models_dir": folder_paths.models_dir, "places": places,
                         "pack": _PACK_MODULE}, protocol=pickle.HIGHEST_PROTOCOL)
