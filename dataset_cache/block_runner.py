"""Running the blocks of a model while it trains: each block its own gradient checkpoint, its weights streamed in
around every run and recompute (:class:`~dataset_cache.weight_stream.WeightStreamer`), or measured by a probe.

A :class:`BlockRunners` replaces each block's ``forward`` (an instance attribute, removed again by
:meth:`BlockRunners.remove`), so every caller of the block goes through it whatever the model's own code does
around it. The checkpoint is torch's non-reentrant one with the RNG state kept, so a recompute computes exactly
what the forward did; the block's top-level tensors are its inputs, which torch saves through the saved-tensor
hooks in force (:class:`~dataset_cache.host_activations.HostActivations` can move them to host memory), and
nothing else keeps them alive.

``reentrant=True`` (opt-in, Train LoRA's ``checkpoint_mode`` "fast") uses torch's reentrant checkpoint instead: the
forward runs without autograd and the backward recomputes the block into an ordinary graph, with far fewer
Python calls and dispatcher ops than the non-reentrant form's per-tensor hooks. Not bit-identical: the gradient
of a tensor every block reads is summed per block, then across blocks (the last bits differ). Its outputs are
flattened for it (nested lists and dicts keep their gradients); a call none of whose tensors requires a gradient
keeps the non-reentrant form (the reentrant one would leave the block's parameters without gradients); and the
recompute, which runs inside the backward, saves its tensors as they are, whatever saved-tensor hooks are in
force there (host activations would otherwise offload a whole block's activations).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.utils.checkpoint
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["BlockRunners", "Probe", "Streamer", "out_of_place_assignments"]

_AUGMENTED = {"__iadd__": "__add__", "__isub__": "__sub__", "__imul__": "__mul__", "__itruediv__": "__truediv__"}
_patch_lock = threading.Lock()
_patch_depth = 0
_patch_saved: dict[str, Any] = {}


def _out_of_place(name: str) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    op = getattr(torch.Tensor, name)

    def assign(self: torch.Tensor, other: Any) -> torch.Tensor:
        out = op(self, other)
        return out if out.dtype == self.dtype else out.to(self.dtype)  # what the in-place op would have kept
    return assign


@contextlib.contextmanager
def out_of_place_assignments() -> Iterator[None]:
    """Within this context ``a += b`` (and ``-=``, ``*=``, ``/=``) on tensors computes ``a + b`` in ``a``'s dtype
    and rebinds ``a``, instead of writing into ``a``.

    Why: Flux's blocks end their residual branches with ``img += ...`` on a tensor a layer norm of the same block
    saved for its backward. Autograd refuses that without checkpointing; with a checkpoint the recompute's saved
    tensors are not version-checked, so the backward reads the modified values (silently wrong gradients: ComfyUI's
    own Flux training at every ``checkpoint_depth``). Out of place, the same numbers are computed and nothing
    saved is overwritten. Only blocks the memory probe saw modify what they saved run under it (it patches
    ``torch.Tensor`` for the block's duration: a block's forward and recompute never run concurrently).
    """
    global _patch_depth
    with _patch_lock:
        if _patch_depth == 0:
            for name, plain in _AUGMENTED.items():
                _patch_saved[name] = torch.Tensor.__dict__.get(name)
                setattr(torch.Tensor, name, _out_of_place(plain))
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                for name in _AUGMENTED:
                    previous = _patch_saved.pop(name)
                    if previous is None:
                        delattr(torch.Tensor, name)
                    else:
                        setattr(torch.Tensor, name, previous)


class Streamer(Protocol):
    """What the runners call around a streamed block (a :class:`~dataset_cache.weight_stream.WeightStreamer`)."""

    def enter(self, index: int, *, recompute: bool) -> None: ...

    def leave(self, index: int, *, recompute: bool) -> None: ...


class Probe(Protocol):
    """Runs a block instead of the runner (the memory probe measures what it saves)."""

    def run(self, index: int, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


def _split(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], list[torch.Tensor]]:
    """The top-level tensors of a call (passed to the checkpoint as its inputs, so torch saves them through the
    saved-tensor hooks in force: host activations can move them) and where they were."""
    where: list[Any] = []
    tensors: list[torch.Tensor] = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            where.append(i)
            tensors.append(a)
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            where.append(k)
            tensors.append(v)
    return where, tensors


def _template(args: tuple[Any, ...], kwargs: dict[str, Any], where: list[Any], *, copy_dicts: bool
              ) -> tuple[list[Any], dict[str, Any]]:
    """The call without its tensors (the checkpoint hands them back, so nothing else keeps them alive). For the
    recompute its dicts are copied: the model updates ``transformer_options`` (``block_index``) between blocks, and
    the recompute must see this block's values."""
    gone = set(where)
    a = [None if i in gone else x for i, x in enumerate(args)]
    k = {n: (None if n in gone else dict(v) if copy_dicts and isinstance(v, dict) else v) for n, v in kwargs.items()}
    return a, k


def _fill(template: tuple[list[Any], dict[str, Any]], where: list[Any], tensors: tuple[torch.Tensor, ...]
          ) -> tuple[list[Any], dict[str, Any]]:
    a, k = list(template[0]), dict(template[1])
    for place, tensor in zip(where, tensors):
        if isinstance(place, int):
            a[place] = tensor
        else:
            k[place] = tensor
    return a, k


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _hooks_lifted() -> contextlib.AbstractContextManager[Any]:
    """Saved tensors kept as they are, whatever saved-tensor hooks are in force outside (the innermost pair
    wins). Only pushed where some hooks are in force: an identity pair still costs two Python calls a tensor."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is not None and top(False) is None:
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_identity, _identity)


def _reentrant_checkpoint(body: Callable[..., Any], tensors: Sequence[torch.Tensor]) -> Any:
    """``body(*tensors)`` through torch's reentrant checkpoint: its output flattened into a tuple (the form the
    reentrant checkpoint takes gradients through) and rebuilt after; the recompute with outer hooks lifted."""
    spec: list[Any] = []

    def flat(*inputs: torch.Tensor) -> tuple[Any, ...]:
        recompute = bool(spec)
        with _hooks_lifted() if recompute else contextlib.nullcontext():
            leaves, structure = tree_flatten(body(*inputs))
        if not recompute:
            spec.append(structure)
        return tuple(leaves)

    leaves = torch.utils.checkpoint.checkpoint(flat, *tensors, use_reentrant=True)
    return tree_unflatten(list(leaves), spec[0])


class BlockRunners:
    """The runner installed as the ``forward`` of each of ``blocks``; :meth:`remove` puts the originals back.

    ``checkpoint``: each block is its own gradient checkpoint while gradients are on, but those in ``whole``
    (block indices the memory plan keeps whole: run as they are, not recomputed). ``streamer`` and
    ``streamed`` (block index → streamer index): those blocks' weights are brought in around each run and
    recompute (a streamed block must be checkpointed: its weights leave the device after its forward). ``probe``:
    every block runs through it instead. ``order`` records the order the blocks first ran in.

    ``copied`` (block index → argument positions or names): inputs a block modifies in place (Flux's blocks add
    to their ``img``/``txt``/``x``), handed to it as copies. Without the copy a checkpoint would recompute from
    the modified tensor (silently wrong gradients: ComfyUI's own ``checkpoint_depth`` 2 does so on Flux), and
    without checkpointing autograd refuses the modified tensor. ``None``: not known, every tensor input is
    copied. The copies are exact: nothing changes in the results. ``out_of_place``: blocks that modify tensors
    they saved for the backward pass, run under :func:`out_of_place_assignments`.

    ``reentrant``: checkpoint through torch's reentrant form where some tensor input requires a gradient (fewer
    host calls; gradients equal up to float rounding, see the module's docstring).
    """

    def __init__(self, blocks: Sequence[torch.nn.Module], *, checkpoint: bool, reentrant: bool = False) -> None:
        self.checkpoint = checkpoint
        self.reentrant = reentrant
        self.whole: set[int] = set()
        self.copied: dict[int, set[Any]] | None = {}
        self.out_of_place: set[int] = set()
        self.streamer: Streamer | None = None
        self.streamed: dict[int, int] = {}
        self.probe: Probe | None = None
        self.order: list[int] = []
        self._installed: list[tuple[torch.nn.Module, Any]] = []
        for index, module in enumerate(blocks):
            self._installed.append((module, module.__dict__.get("forward")))
            module.forward = self._runner(index, module.forward)

    def remove(self) -> None:
        for module, previous in self._installed:
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self._installed.clear()

    @contextlib.contextmanager
    def _around(self, index: int, recompute: bool) -> Iterator[None]:
        key = self.streamed.get(index)
        if not recompute and index not in self.order:
            self.order.append(index)
        with out_of_place_assignments() if index in self.out_of_place else contextlib.nullcontext():
            if self.streamer is None or key is None:
                yield
                return
            self.streamer.enter(key, recompute=recompute)
            try:
                yield
            finally:
                self.streamer.leave(key, recompute=recompute)

    def needs_copies(self) -> bool:
        """Whether some block is handed copies of its inputs or runs out of place (then the runners stay,
        checkpointing or not)."""
        return self.copied is None or any(self.copied.values()) or bool(self.out_of_place)

    def _copies(self, index: int, args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any]
                ) -> tuple[list[Any], dict[str, Any]]:
        copied = self.copied.get(index, set()) if self.copied is not None else None
        if copied is not None and not copied:
            return list(args), kwargs

        def copy(place: Any, value: Any) -> Any:
            return value.clone() if isinstance(value, torch.Tensor) and (copied is None or place in copied) else value

        return [copy(i, a) for i, a in enumerate(args)], {k: copy(k, v) for k, v in kwargs.items()}

    def _runner(self, index: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def run_block(*args: Any, **kwargs: Any) -> Any:
            if self.probe is not None:
                return self.probe.run(index, original, args, kwargs)
            if not (self.checkpoint and torch.is_grad_enabled()) or index in self.whole:
                a, k = self._copies(index, args, kwargs)
                with self._around(index, recompute=False):
                    return original(*a, **k)
            where, tensors = _split(args, kwargs)
            calls = {"forward": _template(args, kwargs, where, copy_dicts=False),
                     "recompute": _template(args, kwargs, where, copy_dicts=True)}
            del args, kwargs

            def body(*inputs: torch.Tensor) -> Any:
                recompute = "forward" not in calls
                a, k = self._copies(index, *_fill(calls["recompute" if recompute else "forward"], where, inputs))
                with self._around(index, recompute):
                    return original(*a, **k)

            if self.reentrant and any(t.requires_grad for t in tensors):
                out = _reentrant_checkpoint(body, tensors)
            else:
                out = torch.utils.checkpoint.checkpoint(body, *tensors, use_reentrant=False)
            del calls["forward"], tensors
            return out
        return run_block
