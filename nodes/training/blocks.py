"""The blocks of a diffusion model: the units that are each their own gradient checkpoint and whose weights can be
streamed (:class:`~dataset_cache.block_runner.BlockRunners` runs them).

Why not ComfyUI's ``find_modules_at_depth`` + ``patch`` (what ``checkpoint_depth`` used to drive): its depth 1 is the
diffusion model itself (the root counts), one checkpoint whose recompute holds every activation again; its
depth 2 is close to per block but also wraps every small layer at the top (embedders, a ``SiLU``), and the UNet's
input/output blocks are ``TimestepEmbedSequential`` containers whose ``forward`` the UNet never calls (it calls
their layers), so the units must be found inside them. The weight streamer needs the same units, their order, and
a hook around each run and recompute, which ComfyUI's ``patch`` does not give.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

__all__ = ["BLOCK_LISTS", "Block", "find_blocks"]

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
