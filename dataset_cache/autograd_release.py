"""Freeing what a backward pass that raised leaves behind.

When a backward pass raises (out of memory in its middle is the usual way a batch or resolution too large for the
device fails), PyTorch's autograd engine can keep the failed graph alive: the nodes it had queued but not run, with
their saved activations, the tensors recomputed for checkpointed blocks, the gradients made so far. A node runs on
the thread of its device: CPU nodes on the thread that called ``backward``, whose queue keeps what the failure left
until that thread runs its next backward pass (pytorch/pytorch#82218; ``tests/unit/test_autograd_release.py`` shows
it); each CUDA device has an autograd thread of its own that drains its queue by itself. Nothing in Python refers to
what the caller's queue keeps, so neither dropping the exception nor ``gc.collect()`` frees it. In ComfyUI the
caller is the prompt worker, whose next backward pass may never come: the memory stays taken while the user
samples, and a retry with a smaller batch starts with less free memory than the first try had. Running a backward
pass of two nodes on the same thread (and one on each device) right after the failure releases it
(:func:`release_failed_backward`).

The error itself holds the rest: its traceback keeps the frames it passed through, and their locals (the step's
batch, its loss, and through the loss every node of the graph the failed pass had not reached yet, with their
saved tensors). ComfyUI keeps the error it reports in a reference cycle (its ``execute`` keeps the traceback in a
local of a frame that traceback holds), so those tensors would live until the collector's next full pass.
:func:`release_error_frames` clears the locals of the frames that have finished, those of the errors it was raised
from included; the traceback still prints the same (files, lines, code), which is all ComfyUI shows. Train LoRA
calls it where the error leaves the pack (the node), so every frame of the run is finished by then: the loop's
(the step's tensors) and the run's (the LoRA, its gradients and the optimizer's state, on the device).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterable

import torch

__all__ = ["release_failed_backward", "release_error_frames"]

log = logging.getLogger("streamcache.train")


def release_failed_backward(devices: Iterable[torch.device | str] = ()) -> None:
    """After a forward or backward pass raised on this thread, free the graph autograd still holds of it.

    Runs a two-node backward pass on the CPU and on each of ``devices``; cheap (microseconds on the CPU, one tiny
    kernel launch per device) and harmless when nothing failed. Never raises: it runs while an error is on its way
    to the user, which it must not replace (a device left unusable by the failure is logged at debug level).
    """
    targets = {torch.device("cpu"), *(torch.device(d) for d in devices)}
    for device in targets:
        try:
            with torch.inference_mode(False), torch.enable_grad():
                leaf = torch.ones(1, device=device, requires_grad=True)
                (leaf * 2.0).sum().backward()
        except Exception:  # a device in an error state: the original error is the one to report
            log.debug("could not run the release backward pass on %s", device, exc_info=True)


def release_error_frames(error: BaseException) -> None:
    """Clear the locals of the finished frames the tracebacks of ``error`` and of the errors it came from
    (``__cause__``, ``__context__``) hold, so whoever keeps the error does not keep the failed run's tensors; frames
    still running (the caller's own) are left as they are. Never raises."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        try:
            traceback.clear_frames(e.__traceback__)
        except Exception:  # the error on its way to the user is the one to report
            log.debug("could not clear the frames of %r", e, exc_info=True)
        pending += [e.__cause__, e.__context__]
