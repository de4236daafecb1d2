"""The blocks of a diffusion model, and the runner each block's forward goes through while a run trains: its own
gradient checkpoint, its weights streamed in around it, or measured by the memory probe.

Why not ComfyUI's ``find_modules_at_depth`` + ``patch`` (what ``checkpoint_depth`` used to drive): its depth 1 is the
diffusion model itself (the root counts), one checkpoint whose recompute holds every activation again; its
depth 2 is close to per block but also wraps every small layer at the top (embedders, a ``SiLU``), and the UNet's
input/output blocks are ``TimestepEmbedSequential`` containers whose ``forward`` the UNet never calls (it calls
their layers), so the units must be found inside them. The weight streamer needs the same units, their order, and
a hook around each run and recompute, which ComfyUI's ``patch`` does not give.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.utils.checkpoint

__all__ = ["BLOCK_LISTS", "Block", "BlockRunners", "find_blocks"]

log = logging.getLogger("streamcache.train")

BLOCK_LISTS = ("input_blocks", "middle_block", "output_blocks",  # UNets (SD1.5, SDXL)
               "double_blocks", "single_blocks",  # Flux, Chroma, HunyuanVideo
               "joint_blocks",  # SD3 (MMDiT)
               "noise_refiner", "context_refiner", "layers",  # Lumina 2
               "transformer_blocks",  # Qwen-Image, LTX-Video
               "blocks")  # WAN, Cosmos
"""Attributes of a diffusion model that hold its blocks, in every family ComfyUI trains (a new family with
other names falls back to the module lists it has: :func:`find_blocks`)."""
_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)


@dataclass(frozen=True)
class Block:
    """One unit of checkpointing and streaming: ``name`` is its path under the diffusion model."""

    name: str
    module: torch.nn.Module


def _units(prefix: str, module: torch.nn.Module) -> list[Block]:
    """The computing modules of a container, opened level by level (a ``TimestepEmbedSequential`` is a container
    whose layers the UNet calls one by one)."""
    if not isinstance(module, _CONTAINERS):
        return [Block(prefix, module)]
    out: list[Block] = []
    for name, child in module.named_children():
        out += _units(f"{prefix}.{name}", child)
    return out


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: torch.nn.Module) -> tuple[list[Block], str]:
    """The blocks of diffusion model ``model`` in definition order, and how they were found (for the log).

    First the known block lists (:data:`BLOCK_LISTS`); a model with none of them: the elements of its module lists;
    a model without module lists: its top-level layers (ComfyUI's depth 2). The two fallbacks say so in the log.
    """
    total = max(1, _params(model))
    named = [(n, c) for n, c in model.named_children() if n in BLOCK_LISTS]
    if named:
        blocks = [b for n, c in named for b in _units(n, c)]
        return blocks, f"{type(model).__name__}'s {', '.join(n for n, _ in named)}"
    lists = [(n, c) for n, c in model.named_children() if isinstance(c, _CONTAINERS) and len(c) > 1]
    blocks = [b for n, c in lists for b in _units(n, c)]
    if blocks and sum(_params(b.module) for b in blocks) >= total // 2:
        how = (f"{type(model).__name__} has no known block list; checkpointing the elements of its module lists "
               f"{', '.join(n for n, _ in lists)}")
        log.warning("Train LoRA: %s", how)
        return blocks, how
    blocks = [b for n, c in model.named_children() for b in _units(n, c)]
    how = (f"{type(model).__name__} has no block lists; checkpointing its {len(blocks)} top-level layers one by one "
           "(as ComfyUI's checkpoint_depth 2)")
    log.warning("Train LoRA: %s", how)
    return blocks, how


class Streamer(Protocol):
    def enter(self, index: int, *, recompute: bool) -> None: ...
    def leave(self, index: int, *, recompute: bool) -> None: ...


class Probe(Protocol):
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


class BlockRunners:
    """The runner installed as each block's ``forward`` for a run; :meth:`remove` puts the originals back.

    ``checkpoint``: each block is its own gradient checkpoint (non-reentrant ``torch.utils.checkpoint``, the RNG
    state kept: a recompute computes exactly what the forward did). ``streamer`` and ``streamed`` (block index →
    streamer index): streamed blocks' weights are brought in around each run and recompute. ``probe``: every block
    runs through it instead (the memory probe measures). Also records the order blocks first ran in.
    """

    def __init__(self, blocks: list[Block], *, checkpoint: bool) -> None:
        self.blocks = blocks
        self.checkpoint = checkpoint
        self.streamer: Streamer | None = None
        self.streamed: dict[int, int] = {}
        self.probe: Probe | None = None
        self.order: list[int] = []
        self._installed: list[tuple[torch.nn.Module, Any]] = []
        for index, block in enumerate(blocks):
            had = "forward" in block.module.__dict__
            self._installed.append((block.module, block.module.__dict__.get("forward") if had else None))
            original = block.module.forward
            block.module.forward = self._runner(index, original)

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
        if self.streamer is None or key is None:
            yield
            return
        self.streamer.enter(key, recompute=recompute)
        try:
            yield
        finally:
            self.streamer.leave(key, recompute=recompute)

    def _runner(self, index: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def run_block(*args: Any, **kwargs: Any) -> Any:
            if self.probe is not None:
                return self.probe.run(index, original, args, kwargs)
            if not (self.checkpoint and torch.is_grad_enabled()):
                with self._around(index, recompute=False):
                    return original(*args, **kwargs)
            where, tensors = _split(args, kwargs)
            calls = {"forward": _template(args, kwargs, where, copy_dicts=False),
                     "recompute": _template(args, kwargs, where, copy_dicts=True)}
            del args, kwargs

            def body(*inputs: torch.Tensor) -> Any:
                recompute = "forward" not in calls
                a, k = _fill(calls["recompute" if recompute else "forward"], where, inputs)
                with self._around(index, recompute):
                    return original(*a, **k)

            out = torch.utils.checkpoint.checkpoint(body, *tensors, use_reentrant=False)
            del calls["forward"], tensors
            return out
        return run_block
