"""The training state of a LoRA, kept beside it so that continuing the LoRA resumes exactly.

A LoRA file holds weights only. Continuing it with an optimizer that keeps state (AdamW's moments) would start
that state afresh, so 3 + 3 steps would not be 6 steps. This module stores what a continuation needs besides the
weights: the optimizer's state, the step count, the number of batches trained (the noise index of the next one)
and the sampler's position.

File: a safetensors file (no pickle anywhere). Each optimizer state tensor is named ``<slot>/<parameter>``
(``exp_avg/diffusion_model.….lora_up.weight``): the parameter by the LoRA key it trains, never by position, so a
reordered model cannot pair a moment with the wrong weight. One metadata entry (:data:`METADATA_KEY`) holds the
rest as JSON: format and version, the LoRA's content digest, the optimizer's name, its parameter groups (their
hyperparameters, and their parameters by name), the counts, the sampler's state and a gradient scaler's.

Name: the LoRA file is written by another node (ComfyUI's "Save LoRA Weights", with a counter in its name), so
the file is named by the content digest of the LoRA's tensors (:func:`lora_digest`), which the LoRA gives again
wherever it is copied or however it is renamed. :class:`~.train_state_store.TrainStateStore` keeps the files in one
folder, writes them atomically and keeps the folder bounded (the least recently used go first, and only files of its
own name pattern; see :meth:`~.train_state_store.TrainStateStore.prune`).

Reading trusts nothing: the header's offsets and sizes are checked against the file (``format.safetensors_io``),
the metadata's fields and types, the digest against the LoRA asked for, every value for NaN and infinity, and
(:func:`check_fits`) each tensor against the parameter it names: a file that fails is named with the reason, and
the caller continues with a fresh optimizer.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from .adafactor import factored_shapes
from .adamw8bit import QUANTIZED_SLOTS
from .lion8bit import QUANTIZED_SLOTS as LION8BIT_SLOTS
from .blockwise8bit import BLOCK
from .errors import CacheError
from .format.durable import atomic_write
from .lr_schedule import LR_SCHEDULES, LrSchedule
from .format.safetensors_io import (
    DTYPE_TO_ST,
    ST_TO_DTYPE,
    build_header,
    open_regular,
    read_header,
    write_safetensors,
)

__all__ = [
    "AVERAGE_SLOTS",
    "METADATA_KEY",
    "OPTIMIZER_SLOTS",
    "TrainState",
    "TrainStateError",
    "capture_optimizer",
    "check_fits",
    "lora_digest",
    "optimizer_state_dict",
    "read_train_state",
    "write_train_state",
]

STATE_FORMAT = "streamcache-train-state"
STATE_VERSION = 1
METADATA_KEY = "streamcache_train_state"
"""The ``__metadata__`` entry that holds the state's JSON."""

OPTIMIZER_SLOTS: Mapping[str, frozenset[str]] = {
    "AdamW": frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    "Adam": frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    "SGD": frozenset({"momentum_buffer"}),
    "RMSprop": frozenset({"step", "square_avg", "momentum_buffer", "grad_avg"}),
    "Prodigy": frozenset({"step", "exp_avg", "exp_avg_sq", "s", "p0"}),
    "Lion": frozenset({"exp_avg"}),
    "Adafactor": frozenset({"exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "exp_avg"}),
    "AdamW8bit": frozenset({"step", "exp_avg", "exp_avg_sq", *QUANTIZED_SLOTS}),
    "Lion8bit": frozenset({"step", "exp_avg", *LION8BIT_SLOTS}),
}
"""Per optimizer (the names ComfyUI's ``_create_optimizer`` knows, Prodigy, Lion, Adafactor, AdamW8bit and
Lion8bit), the per-parameter state it keeps; a file naming another slot is refused. ``step`` is a scalar;
Adafactor's factored second moments have the shapes :func:`~dataset_cache.adafactor.factored_shapes` gives;
AdamW8bit's and Lion8bit's block scales (``*_absmax``) one value per block of 256 elements and their code indices
(``*_q``) are uint8 (:func:`~dataset_cache.blockwise8bit.moment_shapes`); every other slot has its parameter's
shape."""
AVERAGE_SLOTS = ("weights", "average")
"""The slots of a run that averaged its weights (``ema_decay``), whatever its optimizer: ``weights`` the trained
values of the parameter (the LoRA file holds their average), ``average`` that average in fp32."""

_MAX_COUNT = 1 << 53


class TrainStateError(CacheError, ValueError):
    """A training state file that cannot be used: unreadable, not ours, damaged, or for another LoRA."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(f"training state {os.fspath(path)}: {reason}")
        self.path = os.fspath(path)
        self.reason = reason


@dataclass(frozen=True)
class TrainState:
    """What continuing a LoRA needs besides its weights.

    Attributes:
        lora_digest: :func:`lora_digest` of the LoRA these weights were saved with.
        optimizer: the optimizer's name (a key of :data:`OPTIMIZER_SLOTS`).
        steps: optimizer steps the LoRA has had, in total.
        batches: batches trained in total: the index of the next batch's noise and timesteps.
        slots: parameter name → slot → CPU tensor (parameters without state, e.g. never given a gradient, absent).
        param_groups: the optimizer's groups: hyperparameters, and ``"params"``: the parameter names (and state an
            optimizer keeps there: Prodigy's ``d``, ``d_max``, ``d_numerator``, ``k``).
        sampler: the sampler's ``state_dict()`` after the last batch, or ``None``.
        scaler: a ``GradScaler``'s ``state_dict()``, or ``None``.
        lr_schedule: the learning-rate schedule the run trained with
            (:meth:`~dataset_cache.lr_schedule.LrSchedule.as_dict`), or ``None`` (a state written before schedules
            were recorded): a continued run says when its own schedule sets other rates.
        ema_decay: the decay of a run that averaged its weights (:mod:`~dataset_cache.ema`), ``None`` for one that
            did not (or a state written before averages existed).
        weights: with ``ema_decay``, parameter name → its trained value (the LoRA file holds the average).
        average: with ``ema_decay``, parameter name → the fp32 average.
    """

    lora_digest: str
    optimizer: str
    steps: int
    batches: int
    slots: Mapping[str, Mapping[str, torch.Tensor]] = field(default_factory=dict)
    param_groups: tuple[Mapping[str, Any], ...] = ()
    sampler: Mapping[str, Any] | None = None
    scaler: Mapping[str, Any] | None = None
    lr_schedule: Mapping[str, Any] | None = None
    ema_decay: float | None = None
    weights: Mapping[str, torch.Tensor] = field(default_factory=dict)
    average: Mapping[str, torch.Tensor] = field(default_factory=dict)


def lora_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """xxh3-128 (hex) of a LoRA's tensors: names (sorted), dtypes, shapes and bytes, as a saved file gives them back.

    The name of the LoRA's training state: any copy or rename of the file gives the same digest, another LoRA
    (or the same one trained further) another.
    """
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        t = tensors[name].detach()
        h.update(f"{name}\0{t.dtype}\0{list(t.shape)}\0".encode("utf-8", "surrogatepass"))
        h.update(_as_bytes(t))
    return h.hexdigest()


def _as_bytes(t: torch.Tensor) -> Any:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


def capture_optimizer(state_dict: Mapping[str, Any], names: Sequence[str]
                      ) -> tuple[dict[str, dict[str, torch.Tensor]], tuple[dict[str, Any], ...]]:
    """An optimizer's ``state_dict()`` with parameters named: ``(slots, param_groups)`` for :class:`TrainState`.

    ``names[i]`` is the name of the ``i``-th parameter given to the optimizer (torch numbers them in that order
    across the groups). Tensors are copied to the CPU.

    Raises:
        ValueError: the state dict numbers more parameters than ``names`` has.
    """
    slots: dict[str, dict[str, torch.Tensor]] = {}
    for index, values in state_dict["state"].items():
        if not 0 <= int(index) < len(names):
            raise ValueError(f"optimizer state names parameter {index}, but only {len(names)} parameters are named")
        slots[names[int(index)]] = {slot: torch.as_tensor(v).detach().to("cpu").clone() for slot, v in values.items()}
    groups = []
    for group in state_dict["param_groups"]:
        plain = {k: _plain(v) for k, v in group.items() if k != "params"}
        plain["params"] = [names[int(i)] for i in group["params"]]
        groups.append(plain)
    return slots, tuple(groups)


def _plain(value: Any) -> Any:
    """A group value as JSON (tuples as lists, a tensor as its number): recorded for the reader; only the values an
    optimizer keeps its state in are used again (:func:`optimizer_state_dict`'s ``carried``)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    return repr(value)


def optimizer_state_dict(state: TrainState, names: Sequence[str], current: Mapping[str, Any],
                         carried: Sequence[str] = ()) -> dict[str, Any]:
    """The ``state_dict`` to give ``optimizer.load_state_dict``: the saved state of each parameter, by name, in
    this run's numbering, with this run's parameter groups (``current``: the optimizer's own ``state_dict()``), so
    the run's settings (the learning rate) stay what the node says; of the saved groups only the values named in
    ``carried`` are taken, the state an optimizer keeps in its groups (Prodigy's step size).

    Raises:
        ValueError: ``carried`` names a value the saved groups lack or hold as no finite number, or they are not as
            many as this run's.
    """
    index = {name: i for i, name in enumerate(names)}
    groups = [dict(g) for g in current["param_groups"]]
    if carried:
        if len(state.param_groups) != len(groups):
            raise ValueError(f"the state has {len(state.param_groups)} parameter groups, this run {len(groups)}")
        for group, saved in zip(groups, state.param_groups):
            missing = [k for k in carried if k not in saved]
            if missing:
                raise ValueError(f"its parameter groups lack {', '.join(missing)}")
            bad = [k for k in carried if type(saved[k]) not in (int, float) or not math.isfinite(saved[k])]
            if bad:
                raise ValueError(f"its parameter groups' {', '.join(bad)} are not finite numbers")
            group.update({k: saved[k] for k in carried})
    return {"state": {index[name]: dict(values) for name, values in state.slots.items()}, "param_groups": groups}


def check_fits(state: TrainState, optimizer: str, params: Mapping[str, torch.Tensor]) -> str | None:
    """Why ``state``'s optimizer part cannot continue this run's optimizer over ``params`` (name → parameter), or
    ``None`` when it can: another optimizer, a parameter this run lacks, a slot of another shape or kind."""
    if state.optimizer != optimizer:
        return f"it was saved for {state.optimizer}, this run uses {optimizer}"
    for name, values in state.slots.items():
        param = params.get(name)
        if param is None:
            return (f"it holds state for {name!r:.120}, which this run does not train (another rank, algorithm or "
                    "model)")
        for slot, value in values.items():
            if slot == "step":
                continue
            want = _slot_shape(optimizer, slot, tuple(param.shape))
            if tuple(value.shape) != want:
                return (f"its {slot} of {name!r:.120} has shape {list(value.shape)}, the parameter "
                        f"{list(param.shape)}" + ("" if want == tuple(param.shape) else f" (needing {list(want)})"))
            if not _kind_fits(slot, value):
                return f"its {slot} of {name!r:.120} is {value.dtype}, not {_slot_kind(slot)}"
    return None


def _slot_shape(optimizer: str, slot: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape ``optimizer``'s ``slot`` has for a parameter of ``shape``."""
    if optimizer == "Adafactor" and slot.startswith("exp_avg_sq"):
        return factored_shapes(shape).get(slot, (-1,))  # a matrix's "exp_avg_sq", a vector's row: never fits
    if optimizer in ("AdamW8bit", "Lion8bit") and slot.endswith("_absmax"):
        return (-(-math.prod(shape) // BLOCK),)
    return shape


def _slot_kind(slot: str) -> str:
    """What a slot's values must be: the 8-bit optimizers' code indices bytes, every other slot floating point."""
    return "uint8 (code indices)" if slot.endswith("_q") else "floating point"


def _kind_fits(slot: str, value: torch.Tensor) -> bool:
    """Whether ``value`` is of :func:`_slot_kind`'s kind."""
    return value.dtype == torch.uint8 if slot.endswith("_q") else value.is_floating_point()


def check_average_fits(state: TrainState, params: Mapping[str, torch.Tensor]) -> str | None:
    """Why ``state``'s trained weights and average cannot continue this run's ``params``, or ``None`` when they
    can (or the state has none): both must name exactly this run's parameters, each with its shape."""
    for slot, values in (("weights", state.weights), ("average", state.average)):
        if not values:
            continue
        if set(values) != set(params):
            missing = sorted(set(params) - set(values)) or sorted(set(values) - set(params))
            return f"its {slot} name other parameters than this run trains (e.g. {missing[0]!r:.120})"
        for name, value in values.items():
            if tuple(value.shape) != tuple(params[name].shape):
                return (f"its {slot} of {name!r:.120} has shape {list(value.shape)}, the parameter "
                        f"{list(params[name].shape)}")
    return None


def write_train_state(path: str | os.PathLike[str], state: TrainState) -> int:
    """Write ``state`` to ``path`` atomically (temp file, fsync, rename); return the bytes written."""
    tensors = sorted([(f"{slot}/{name}", value) for name, values in state.slots.items()
                      for slot, value in values.items()]
                     + [(f"{slot}/{name}", value) for slot, values in (("weights", state.weights),
                                                                        ("average", state.average))
                        for name, value in values.items()])
    for key, value in tensors:
        if value.dtype not in DTYPE_TO_ST:
            raise ValueError(f"optimizer state {key}: dtype {value.dtype} cannot be stored in safetensors")
    meta = {
        "format": STATE_FORMAT, "version": STATE_VERSION, "lora_digest": state.lora_digest,
        "optimizer": state.optimizer, "steps": state.steps, "batches": state.batches,
        "param_groups": list(state.param_groups), "sampler": state.sampler, "scaler": state.scaler,
    }
    if state.lr_schedule is not None:  # optional: states written before it was recorded lack it
        meta["lr_schedule"] = dict(state.lr_schedule)
    if state.ema_decay is not None:  # optional, as the weights/ and average/ tensors it comes with
        meta["ema_decay"] = float(state.ema_decay)
    text = json.dumps(meta, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    header = build_header([(k, DTYPE_TO_ST[v.dtype], tuple(v.shape)) for k, v in tensors], {METADATA_KEY: text})

    def write(f: Any) -> int:
        return write_safetensors(f, header, (_as_bytes(v) for _, v in tensors))

    return atomic_write(Path(os.path.abspath(path)), write)


def read_train_state(path: str | os.PathLike[str], *, digest: str, max_bytes: int) -> TrainState:
    """Read and check a training state file written by :func:`write_train_state` for the LoRA of ``digest``.

    Args:
        path: the file (a link is refused).
        digest: :func:`lora_digest` of the LoRA being continued; the file must say the same.
        max_bytes: the largest file accepted (the caller bounds it by what its parameters' state can take).

    Raises:
        TrainStateError: naming the file and what is wrong: unreadable, a link, too large, not a safetensors file
            of this format and version, a header whose offsets or sizes do not match the file, missing or
            mistyped fields, another LoRA's digest, an unknown optimizer or slot, a tensor name that is not
            ``<slot>/<parameter>``, a parameter group naming a parameter twice, or a NaN or infinite value.
    """
    try:
        fd = open_regular(path)
    except (OSError, CacheError) as exc:
        raise TrainStateError(path, f"cannot be opened ({exc})") from None
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise TrainStateError(path, f"is {size} bytes, more than the {max_bytes} this LoRA's state can take")
        try:
            header = read_header(path, fd, size)
            data = os.pread(fd, size - header.data_start, header.data_start) if hasattr(os, "pread") else _read_at(
                fd, header.data_start, size - header.data_start)
        except (OSError, CacheError) as exc:
            raise TrainStateError(path, f"is not a valid safetensors file ({exc})") from None
    finally:
        os.close(fd)
    if len(data) != size - header.data_start:
        raise TrainStateError(path, "changed while it was read")
    meta = _metadata(path, header.metadata.get(METADATA_KEY))
    if meta["lora_digest"] != digest:
        raise TrainStateError(path, f"was written for another LoRA (digest {meta['lora_digest']:.40}, this one's is "
                                    f"{digest})")
    allowed = OPTIMIZER_SLOTS[meta["optimizer"]]
    slots: dict[str, dict[str, torch.Tensor]] = {}
    averaged: dict[str, dict[str, torch.Tensor]] = {slot: {} for slot in AVERAGE_SLOTS}
    for key, span in header.tensors.items():
        slot, sep, name = key.partition("/")
        if not sep or not name or not (slot in allowed or (slot in AVERAGE_SLOTS and "ema_decay" in meta)):
            raise TrainStateError(path, f"tensor {key!r:.120} is not <slot>/<parameter> with a slot of "
                                        f"{meta['optimizer']} ({', '.join(sorted(allowed))})"
                                        + (f" or {' or '.join(AVERAGE_SLOTS)}" if "ema_decay" in meta else ""))
        dtype = ST_TO_DTYPE[span.dtype]
        raw = data[span.begin:span.end]
        value = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(span.shape).clone() if raw else \
            torch.empty(span.shape, dtype=dtype)
        _check_value(path, key, slot, value)
        if slot in AVERAGE_SLOTS:
            averaged[slot][name] = value
        else:
            slots.setdefault(name, {})[slot] = value
    if "ema_decay" in meta and set(averaged["weights"]) != set(averaged["average"]):
        raise TrainStateError(path, "its weights/ and average/ tensors name different parameters")
    groups = _groups(path, meta["param_groups"])
    return TrainState(meta["lora_digest"], meta["optimizer"], meta["steps"], meta["batches"], slots, groups,
                      meta["sampler"], meta["scaler"], meta.get("lr_schedule"), meta.get("ema_decay"),
                      averaged["weights"], averaged["average"])


def _read_at(fd: int, offset: int, n: int) -> bytes:
    os.lseek(fd, offset, os.SEEK_SET)
    return os.read(fd, n)


def _metadata(path: str | os.PathLike[str], text: str | None) -> dict[str, Any]:
    if text is None:
        raise TrainStateError(path, f"has no {METADATA_KEY} metadata: not a StreamCache training state")
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError):
        raise TrainStateError(path, f"its {METADATA_KEY} metadata is not valid JSON") from None
    if type(meta) is not dict or meta.get("format") != STATE_FORMAT:
        raise TrainStateError(path, "is not a StreamCache training state (its format field says otherwise)")
    if meta.get("version") != STATE_VERSION:
        raise TrainStateError(path, f"has version {meta.get('version')!r:.20}; this version reads {STATE_VERSION}")
    checks = (("lora_digest", lambda v: type(v) is str and re.fullmatch(r"[0-9a-f]{32}", v) is not None),
              ("optimizer", lambda v: v in OPTIMIZER_SLOTS),
              ("steps", lambda v: type(v) is int and 0 <= v <= _MAX_COUNT),
              ("batches", lambda v: type(v) is int and 0 <= v <= _MAX_COUNT),
              ("param_groups", lambda v: type(v) is list),
              ("sampler", lambda v: v is None or type(v) is dict),
              ("scaler", lambda v: v is None or type(v) is dict))
    if "ema_decay" in meta:  # optional (written since 2026-11-27, by runs that averaged their weights)
        decay = meta["ema_decay"]
        if not (type(decay) in (int, float) and 0.0 < decay < 1.0):
            raise TrainStateError(path, f"its metadata's ema_decay is not valid ({decay!r:.60})")
    for name, ok in checks:
        if name not in meta:
            raise TrainStateError(path, f"its metadata has no {name!r}")
        if not ok(meta[name]):
            raise TrainStateError(path, f"its metadata's {name} is not valid ({meta[name]!r:.60})")
    schedule = meta.get("lr_schedule")
    if schedule is not None:
        try:
            if type(schedule) is not dict or type(schedule.get("kind")) is not str:
                raise ValueError("not an object with a kind")
            LrSchedule.from_dict({**schedule, "kind": LR_SCHEDULES[0]})  # a later version's kind is kept, not refused
        except (ValueError, TypeError) as exc:
            raise TrainStateError(path, f"its metadata's lr_schedule is not valid ({exc})") from None
    return meta


def _check_value(path: str | os.PathLike[str], key: str, slot: str, value: torch.Tensor) -> None:
    if slot != "step":
        if not _kind_fits(slot, value):
            raise TrainStateError(path, f"tensor {key!r:.120} is {value.dtype}, not {_slot_kind(slot)}")
        if not bool(torch.isfinite(value).all()):
            raise TrainStateError(path, f"tensor {key!r:.120} holds NaN or infinite values")
        return
    if value.dtype not in (torch.int64, torch.int32) and not value.is_floating_point():
        raise TrainStateError(path, f"tensor {key!r:.120} is {value.dtype}, not a number")
    if value.numel() != 1:
        raise TrainStateError(path, f"tensor {key!r:.120} is a step count of shape {list(value.shape)}, not a scalar")
    step = float(value.reshape(()).item())
    if not (math.isfinite(step) and 0 <= step <= _MAX_COUNT and step == int(step)):
        raise TrainStateError(path, f"tensor {key!r:.120} is not a step count ({step})")


def _groups(path: str | os.PathLike[str], groups: list[Any]) -> tuple[dict[str, Any], ...]:
    seen: set[str] = set()
    out = []
    for group in groups:
        params = group.get("params") if type(group) is dict else None
        if type(params) is not list or any(type(p) is not str for p in params):
            raise TrainStateError(path, "a parameter group does not list its parameters by name")
        if seen.intersection(params) or len(set(params)) != len(params):
            raise TrainStateError(path, "a parameter is listed in two parameter groups")
        seen.update(params)
        out.append(group)
    return tuple(out)
