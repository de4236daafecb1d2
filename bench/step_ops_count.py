"""Counting the dispatcher ops of training steps on the CPU, as a GPU would see them (``scripts/bench-step-ops``).

At batch 1 a GPU training step is launch-bound: its time is about (ops the training thread dispatches) × (host
cost per op), and the ops can be counted exactly on the CPU. :class:`OpCounter` is a ``TorchDispatchMode`` (it sees
every aten op after autograd, once; modes are thread-local, so the loader's threads are not counted). Each op gets:

* a **phase**: ``forward`` (inside ``BaseModel.apply_model``), ``recompute`` (a checkpoint's forward run again
  during the backward: inside an autograd graph task with grad mode on), ``backward`` (inside a graph task, grad
  mode off), ``optimizer`` (between torch's global optimizer step hooks), ``loop`` (everything else: batch
  preparation, conditioning, the loss, bookkeeping);
* a **kind**, mirroring a CUDA run: ``kernel`` (launches work on the device), ``meta`` (no kernel: views, detach,
  empty allocations; :data:`METADATA_OPS`), ``sync`` (the host waits for the device: :data:`SYNC_OPS` on device
  tensors) or ``host`` (on tensors a GPU run keeps on the host: AdamW's ``step`` counters, which torch keeps on
  the CPU unless ``capturable``; outside the model, tensors made from nothing (random draws with the CPU's
  generator, ``torch.tensor(data)``, ``torch.arange(n)``: factories rarely name a device there) and whatever is
  computed from host tensors alone);
* a **site**: the innermost Python frame outside torch and this benchmark (:func:`site_of`), grouped into
  :data:`CATEGORIES` (ComfyUI's weight cast, its LoRA adapter, the model's layers, ...).

What the CPU cannot show (said in the report): host-to-device copies (``.to(device)`` is not an op when the device is
the CPU), bf16 autocast's casts (the stand-in trains in fp32), and kernels a fused CUDA op launches several times
(a ``_foreach_*`` op launches one kernel per ~50–110 tensors).
"""

from __future__ import annotations

import collections
import functools
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .step_ops_transfers import Transfers

__all__ = ["METADATA_OPS", "SYNC_OPS", "HOST_DRAWS", "PHASES", "KINDS", "CATEGORIES", "OpCounter", "StepCounts",
           "site_of", "caller_of", "cuda_like_optimizers", "cuda_like_attention", "phases_marked"]

METADATA_OPS = frozenset({
    # views and aliases: a new tensor header over the same storage
    "view", "_unsafe_view", "_reshape_alias", "t", "transpose", "permute", "unsqueeze", "squeeze", "expand",
    "slice", "select", "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind", "chunk", "narrow",
    "diagonal", "unfold", "view_as_real", "view_as_complex", "real", "imag", "_conj", "_neg_view", "lift_fresh",
    "t_", "transpose_", "squeeze_", "unsqueeze_", "detach_", "as_strided_",
    # allocations (the caching allocator, no kernel) and shape-only queries
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_", "is_same_size",
    "_has_compatible_shallow_copy_type", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
    # the profiler's ranges (``record_function``, e.g. in ``Optimizer.zero_grad``): host bookkeeping
    "_record_function_enter", "_record_function_enter_new", "_record_function_exit",
})
"""Ops that launch no kernel on a GPU: views, aliases, allocations, shape queries."""
SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
                      "unique_consecutive", "unique_dim", "equal"})
"""Ops on device tensors that make the host wait for the device (``.item()``/``float(t)`` is ``_local_scalar_dense``;
the others need a result's size or value on the host)."""
HOST_DRAWS = frozenset({"multinomial", "normal", "bernoulli"})
"""Random draws that take a tensor and are made on the host outside the model (the built-in's choice of bucket)."""
PHASES = ("forward", "recompute", "backward", "optimizer", "loop")
KINDS = ("kernel", "meta", "sync", "host")
CATEGORIES = {
    "cast": "ComfyUI weight cast (`comfy/ops.py` cast_bias_weight, `model_management.cast_to`)",
    "adapter": "ComfyUI's LoRA adapter (`comfy/weight_adapter`)",
    "bias": "ComfyUI's bias and norm adapter (`BiasDiff` in `comfy_extras/nodes_train.py`; both trainers use it)",
    "model": "the model's layers (`comfy/ldm`, `comfy/ops.py` forwards)",
    "wrapper": "ComfyUI's model wrapper and conditioning (`model_base`, `samplers`, `conds`, ...)",
    "checkpoint": "torch's checkpoint machinery (`torch/utils/checkpoint.py`)",
    "runner": "our block runner (`dataset_cache/block_runner.py`)",
    "ours": "our loop (`nodes/training`, the loader)",
    "builtin": "the built-in's loop (`comfy_extras/nodes_train.py`)",
    "backward": "autograd's backward",
    "optimizer": "torch's optimizer (AdamW)",
    "other": "other",
}
"""Where an op comes from (key → what it covers)."""

_CAST_FUNCTIONS = frozenset({"cast_bias_weight", "uncast_bias_weight", "cast_to", "cast_to_input", "cast_to_device"})
_TRANSPARENT = "transparent"


@dataclass
class StepCounts:
    """Ops counted over ``steps`` windows (one optimizer step each): ``by`` (phase, kind, category) → ops, ``ops``
    ``category|kind:name`` → ops, ``sites`` ``category|path:function`` → ops, ``totals`` the total of each window
    and ``windows`` each window's ``by`` (equal when the counting is deterministic, as it is on the CPU); ``calls``
    (phase, category) → the Python function calls of the training thread in one more step, counted without the
    dispatch mode (whose own Python would inflate them)."""

    steps: int = 0
    by: collections.Counter = field(default_factory=collections.Counter)
    ops: collections.Counter = field(default_factory=collections.Counter)
    sites: collections.Counter = field(default_factory=collections.Counter)
    totals: list[int] = field(default_factory=list)
    windows: list[collections.Counter] = field(default_factory=list)
    calls: collections.Counter = field(default_factory=collections.Counter)

    def per_step(self, phase: str | None = None, kind: str | None = None, category: str | None = None) -> float:
        """Ops per step matching the given phase / kind / category (``None``: any)."""
        n = sum(v for (p, k, c), v in self.by.items()
                if (phase is None or p == phase) and (kind is None or k == kind)
                and (category is None or c == category))
        return n / max(self.steps, 1)

    def calls_per_step(self, phase: str | None = None, category: str | None = None) -> int:
        return sum(v for (p, c), v in self.calls.items()
                   if (phase is None or p == phase) and (category is None or c == category))

    def to_json(self) -> dict[str, Any]:
        def rows(c: collections.Counter) -> list[list[Any]]:
            return [[*key, v] for key, v in sorted(c.items())]

        return {"steps": self.steps, "by": rows(self.by), "ops": dict(self.ops.most_common()),
                "sites": dict(self.sites.most_common()), "totals": self.totals,
                "windows": [rows(w) for w in self.windows], "calls": rows(self.calls)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StepCounts:
        def counter(rows: list[list[Any]]) -> collections.Counter:
            return collections.Counter({tuple(r[:-1]): r[-1] for r in rows})

        return cls(d["steps"], counter(d["by"]), collections.Counter(d["ops"]), collections.Counter(d["sites"]),
                   list(d["totals"]), [counter(w) for w in d["windows"]], counter(d["calls"]))


class _Roots:
    """Where files are: torch, ComfyUI, the pack, this benchmark (for :func:`site_of`)."""

    def __init__(self) -> None:
        import torch

        import comfy.model_base

        self.torch = str(Path(torch.__file__).resolve().parent) + "/"
        self.comfy = str(Path(comfy.model_base.__file__).resolve().parents[1]) + "/"
        self.pack = str(Path(__file__).resolve().parents[1]) + "/"
        self.bench = str(Path(__file__).resolve().parent) + "/"


_roots: _Roots | None = None
_code_sites: dict[Any, tuple[str, str]] = {}


def _classify(code: Any) -> tuple[str, str]:
    """(category or :data:`_TRANSPARENT` / ``torch:<part>``, ``path:function``) of one code object."""
    global _roots
    if _roots is None:
        _roots = _Roots()
    r = _roots
    path = str(Path(code.co_filename).resolve()) if not code.co_filename.startswith("<") else code.co_filename
    name = code.co_name
    if path.startswith(r.torch):
        rel = path[len(r.torch):]
        part = "checkpoint" if rel.startswith("utils/checkpoint.py") else "optim" if rel.startswith("optim/") else ""
        return f"torch:{part}", f"torch/{rel}:{name}"
    if path.startswith(r.bench):
        return _TRANSPARENT, ""
    if path.startswith(r.comfy):
        rel = path[len(r.comfy):]
        site = f"{rel}:{name}"
        if rel.startswith("comfy/weight_adapter/"):
            return "adapter", site
        if rel == "comfy/model_management.py" or (rel == "comfy/ops.py" and name in _CAST_FUNCTIONS):
            return "cast", site
        if rel.startswith("comfy/ldm/") or rel == "comfy/ops.py":
            return "model", site
        if rel == "comfy_extras/nodes_train.py" and name == "__call__":
            return "bias", site  # BiasDiff, the adapter of biases and norms ComfyUI's _setup_lora_adapters makes
        if rel.startswith("comfy_extras/"):
            return "builtin", site
        return "wrapper", site
    if path.startswith(r.pack):
        rel = path[len(r.pack):]
        return ("runner" if rel == "dataset_cache/block_runner.py" else "ours"), f"{rel}:{name}"
    return "other", f"{Path(path).name}:{name}"


def site_of(frame: Any) -> tuple[str, str]:
    """(category, ``path:function``) of the innermost frame from ``frame`` outward that is neither torch's nor this
    benchmark's; ``checkpoint`` when torch's checkpoint code stands between (its own ops: RNG state, detached
    inputs)."""
    via = ""
    while frame is not None:
        code = frame.f_code
        got = _code_sites.get(code)
        if got is None:
            got = _code_sites[code] = _classify(code)
        category, site = got
        if category.startswith("torch:"):
            via = via or category[6:]
        elif category != _TRANSPARENT:
            if via == "checkpoint":
                return "checkpoint", "torch/utils/checkpoint.py"
            return category, site
        frame = frame.f_back
    return "other", "?"


def caller_of(frame: Any, limit: int = 24) -> str:
    """Whom a Python call is made for: the category of the innermost frame from ``frame`` outward that is neither
    torch's, the standard library's nor this benchmark's (a module's ``__call__`` machinery called by the model's
    layers counts for the model), ``checkpoint`` when torch's checkpoint code stands between, ``torch`` when no such
    frame is within ``limit`` frames."""
    via = False
    for _ in range(limit):
        if frame is None:
            break
        code = frame.f_code
        got = _code_sites.get(code)
        if got is None:
            got = _code_sites[code] = _classify(code)
        category = got[0]
        if category == "torch:checkpoint":
            via = True
        elif not (category.startswith("torch:") or category in (_TRANSPARENT, "other")):
            return "checkpoint" if via else category
        frame = frame.f_back
    return "checkpoint" if via else "torch"


def _tensors(tree: Any) -> Iterator[Any]:
    import torch
    from torch.utils._pytree import tree_leaves

    return (t for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def _make_mode_class() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Mode(TorchDispatchMode):
        def __init__(self, counter: OpCounter) -> None:
            super().__init__()
            self.counter = counter

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            self.counter.record(func.overloadpacket.__name__, args, kwargs, out, sys._getframe(1))
            return out

    return _Mode


class OpCounter:
    """Counts the ops of the training thread between :meth:`start` and :meth:`stop` (see the module docstring).

    From :meth:`start` the mode is on and host tensors are followed, but nothing is counted until
    :meth:`count` (so a window's host tensors made in the step before are known, as in every later window);
    each :meth:`boundary` closes a window. The phase flags are set by :func:`phases_marked` (the model call, the
    optimizer step). Host tensors: AdamW's step counters (registered at each optimizer step), :data:`HOST_DRAWS`
    in the loop, and what is computed from host tensors alone; copies between host and device (no-ops on the
    CPU) are counted by :class:`bench.step_ops_transfers.Transfers`.
    """

    def __init__(self) -> None:
        self.counts = StepCounts()
        self.model_depth = 0
        self.in_optimizer = False
        self.counting = False
        self._host: dict[int, Any] = {}
        self._window: collections.Counter = collections.Counter()
        self._mode: Any = None
        self._transfers: Any = None
        self._calls_on = False

    # -------------------------------------------------------------------------------------------- host tensors
    def mark_host(self, tensor: Any) -> None:
        key = id(tensor)
        if key not in self._host:
            self._host[key] = weakref.ref(tensor, functools.partial(self._forget_host, key))

    def _forget_host(self, key: int, _ref: object) -> None:
        self._host.pop(key, None)

    def is_host(self, tensor: Any) -> bool:
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def unmark_host(self, tensor: Any) -> None:
        if self.is_host(tensor):
            del self._host[id(tensor)]

    # -------------------------------------------------------------------------------------------- windows
    def start_calls(self) -> None:
        """Count Python calls of this thread until :meth:`stop_calls` (one step, before the mode is on)."""
        self._calls_on = True
        sys.setprofile(self._profile)

    def stop_calls(self) -> None:
        sys.setprofile(None)
        self._calls_on = False

    def start(self) -> None:
        """Turn the mode on (this thread): host tensors are followed from here, nothing counted yet."""
        if self._mode is not None:
            return
        self._mode = _make_mode_class()(self)
        self._mode.__enter__()
        self._transfers = Transfers(self)
        self._transfers.install()

    def count(self) -> None:
        """Count from here (the first window starts)."""
        self.counting = True
        self._window = collections.Counter()

    def boundary(self) -> None:
        """A step ended: close its window."""
        if not self.counting:
            return
        self.counts.windows.append(self._window)
        self.counts.by.update(self._window)
        self.counts.totals.append(sum(self._window.values()))
        self.counts.steps += 1
        self._window = collections.Counter()

    def stop(self) -> None:
        self.counting = False
        if self._calls_on:
            self.stop_calls()
        if self._mode is not None:
            self._transfers.remove()
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    # -------------------------------------------------------------------------------------------- one op
    def phase(self) -> str:
        import torch

        if self.in_optimizer:
            return "optimizer"
        if torch._C._current_graph_task_id() != -1:
            return "recompute" if torch.is_grad_enabled() else "backward"
        return "forward" if self.model_depth > 0 else "loop"

    def record(self, name: str, args: Any, kwargs: Any, out: Any, frame: Any) -> None:
        phase = self.phase()
        kind = self._kind(name, phase, args, kwargs, out)
        if self.counting:
            self.add_op(phase, kind, name, frame)

    def add_op(self, phase: str, kind: str, name: str, frame: Any) -> None:
        """Count one op (or a copy :mod:`bench.step_ops_transfers` saw) made from ``frame``."""
        if phase == "backward":
            category, site = "backward", "autograd backward"
        elif phase == "optimizer":
            category, site = "optimizer", "torch.optim"
        else:
            category, site = site_of(frame)
        c = self.counts
        self._window[(phase, kind, category)] += 1
        c.ops[f"{category}|{kind}:{name}"] += 1
        c.sites[f"{category}|{site}"] += 1

    def _kind(self, name: str, phase: str, args: Any, kwargs: Any, out: Any) -> str:
        host = False
        if phase in ("loop", "optimizer"):
            inputs = list(_tensors((args, kwargs)))
            if name == "copy_" and len(inputs) >= 2 and self.is_host(inputs[0]) != self.is_host(inputs[1]):
                return "kernel" if kwargs.get("non_blocking") or (len(args) > 2 and args[2]) else "sync"
            if phase == "loop":  # made without a device (torch.tensor(data, device=...) is Transfers' to judge)
                host = not inputs or name in HOST_DRAWS or name == "lift_fresh"
            host = host or (bool(inputs) and all(map(self.is_host, inputs)))
            if host:
                for t in _tensors(out):
                    self.mark_host(t)
        if host:
            return "host"
        if name in SYNC_OPS:
            return "sync"
        return "meta" if name in METADATA_OPS else "kernel"

    # -------------------------------------------------------------------------------------------- Python calls
    def _profile(self, frame: Any, event: str, _arg: Any) -> None:
        """``sys.setprofile`` hook: each Python function call of the training thread, by phase and by whom it is
        made for (:func:`caller_of`): the interpreter's share of a step's host time."""
        if event != "call":
            return
        phase = self.phase()
        category = phase if phase in ("backward", "optimizer") else caller_of(frame)
        self.counts.calls[(phase, category)] += 1


@contextmanager
def phases_marked(counter: OpCounter) -> Iterator[None]:
    """Mark the model call (``BaseModel.apply_model``, whatever subclass) and the optimizer step for ``counter``
    while inside; AdamW's ``step`` counters are registered as host tensors at each step."""
    import torch.optim.optimizer as topt

    import comfy.model_base

    base = comfy.model_base.BaseModel
    original = base.__dict__["apply_model"]

    def apply_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        counter.model_depth += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            counter.model_depth -= 1

    def pre(optimizer: Any, _args: Any, _kwargs: Any) -> None:
        counter.in_optimizer = True
        for state in optimizer.state.values():
            step = state.get("step") if isinstance(state, dict) else None
            if step is not None and hasattr(step, "is_cpu"):
                counter.mark_host(step)

    def post(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        counter.in_optimizer = False

    base.apply_model = apply_model
    handles = [topt.register_optimizer_step_pre_hook(pre), topt.register_optimizer_step_post_hook(post)]
    try:
        yield
    finally:
        base.apply_model = original
        for h in handles:
            h.remove()


@contextmanager
def cuda_like_optimizers() -> Iterator[None]:
    """Optimizers left at ``foreach=None`` pick the ``foreach`` implementation on the CPU too, as they do on CUDA
    (torch's default there; on the CPU it would run its per-parameter loop: ~10 ops and an ``.item()`` per
    parameter)."""
    import torch.optim.optimizer as topt

    original: Callable[[], list[str]] = topt._get_foreach_kernels_supported_devices

    def with_cpu() -> list[str]:
        return [*original(), "cpu"]

    topt._get_foreach_kernels_supported_devices = with_cpu
    try:
        yield
    finally:
        topt._get_foreach_kernels_supported_devices = original


@contextmanager
def cuda_like_attention() -> Iterator[None]:
    """ComfyUI's models attend with ``attention_pytorch`` (torch's scaled-dot-product attention, one op) as ComfyUI
    picks on an NVIDIA GPU, instead of the sub-quadratic attention it picks on the CPU (dozens of ops a call): every
    ComfyUI module's ``optimized_attention`` / ``optimized_attention_masked`` is switched while inside."""
    import comfy.ldm.modules.attention as attention

    chosen = {attention.optimized_attention, attention.optimized_attention_masked}
    saved: list[tuple[Any, str, Any]] = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "comfy" or name.startswith("comfy.")):
            continue
        for attr in ("optimized_attention", "optimized_attention_masked"):
            value = getattr(module, attr, None)
            if value is not None and value in chosen and value is not attention.attention_pytorch:
                saved.append((module, attr, value))
                setattr(module, attr, attention.attention_pytorch)
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)
