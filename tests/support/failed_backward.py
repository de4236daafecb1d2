"""A backward pass that fails in its middle, as one that runs out of device memory does, for the tests of
``dataset_cache.autograd_release`` and of what calls it."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["BackwardError", "python_error", "engine_error", "failing_backward"]


class BackwardError(RuntimeError):
    """Raised in Python during a backward pass (an out-of-memory error while a checkpointed block is recomputed)."""


def python_error(grad: torch.Tensor) -> torch.Tensor:
    raise BackwardError("out of memory (raised in Python during backward)")


def engine_error(grad: torch.Tensor) -> torch.Tensor:
    return grad.new_zeros(3)  # the engine raises (C++, as a kernel out of memory): a hook may not change a size


def failing_backward(refs: list[weakref.ref[torch.Tensor]], hook: Callable[[torch.Tensor], torch.Tensor] = engine_error,
                     wrap: str = "none", device: str = "cpu", rows: int = 64) -> None:
    """Forward and backward through two branches, the failing one first (so the other's work is queued when it
    fails, as in a real model); appends to ``refs`` a weak reference to a tensor the graph saved, then raises the
    backward pass's error. ``wrap``: none, or the failing block checkpointed (``exact``: non-reentrant, ``fast``:
    reentrant)."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(256, 256, generator=gen).to(device).requires_grad_() for _ in range(4)]
    x = torch.randn(rows, 256, generator=gen).to(device)
    saved = (x @ weights[0]).relu()
    refs.append(weakref.ref(saved))

    def block(h: torch.Tensor) -> torch.Tensor:
        out = (h @ weights[1]).relu() @ weights[2]
        if out.requires_grad:  # a reentrant checkpoint's first forward runs without grad: its recompute registers
            out.register_hook(hook)
        return out

    other = (saved @ weights[3]).relu()  # made first, so its backward comes after the failing branch's: pending
    failing = block(saved) if wrap == "none" else checkpoint(block, saved, use_reentrant=wrap == "fast")
    (failing * other).sum().backward()
