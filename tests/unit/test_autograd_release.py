"""``release_failed_backward``: what a backward pass that raised leaves alive is freed on the same thread.

Each case fails a backward pass of a small model the way a real run fails: an error raised in Python in the middle
of it (an out-of-memory error while a checkpointed block is recomputed runs through Python), an error raised by the
engine itself (C++: an out-of-memory error in a kernel), inside a non-reentrant and a reentrant checkpoint. A weak
reference to an activation the graph saved tells whether the graph is still alive: a tensor kept by C++ keeps its
Python object, and with it the weak reference, alive.
"""

from __future__ import annotations

import gc
import traceback
import weakref
from collections.abc import Callable

import pytest
import torch

from dataset_cache.autograd_release import release_error_frames, release_failed_backward
from support.failed_backward import BackwardError, engine_error, failing_backward, python_error


def _failed_step(hook: Callable[[torch.Tensor], torch.Tensor], wrap: str, device: str = "cpu",
                 rows: int = 64) -> weakref.ref[torch.Tensor]:
    """A backward pass that failed (:func:`support.failed_backward.failing_backward`); a weak reference to a tensor
    its graph saved."""
    refs: list[weakref.ref[torch.Tensor]] = []
    with pytest.raises(RuntimeError):  # BackwardError is one
        failing_backward(refs, hook, wrap, device, rows)
    return refs[0]


def _alive(ref: weakref.ref[torch.Tensor]) -> bool:
    gc.collect()
    return ref() is not None


@pytest.mark.parametrize("hook", [python_error, engine_error], ids=["python-error", "engine-error"])
@pytest.mark.parametrize("wrap", ["none", "exact", "fast"])
def test_the_failed_graph_is_kept_by_autograd_until_the_release(hook: Callable[[torch.Tensor], torch.Tensor],
                                                                 wrap: str) -> None:
    """Nothing in Python holds the failed graph, and ``gc.collect()`` does not free it; the release does. Skipped
    where a torch frees it by itself (pytorch/pytorch#82218 fixed: the release then does no harm)."""
    ref = _failed_step(hook, wrap)
    if not _alive(ref):
        pytest.skip(f"torch {torch.__version__} frees a failed backward pass's graph by itself")
    release_failed_backward()
    assert not _alive(ref)


def test_the_release_works_under_inference_mode() -> None:
    """ComfyUI runs nodes under ``torch.inference_mode()``, where no backward pass could run."""
    ref = _failed_step(python_error, "exact")
    with torch.inference_mode():
        release_failed_backward()
    assert not _alive(ref)


def test_the_release_never_raises() -> None:
    """It runs while the failure's own error is on its way to the user: a device it cannot use is skipped."""
    ref = _failed_step(python_error, "none")
    release_failed_backward(["cuda:97"])  # no machine that runs this has 98 GPUs; the CPU is still released
    assert not _alive(ref)


def _raise_with(refs: list[weakref.ref[torch.Tensor]]) -> None:
    step_tensor = torch.ones(1000)  # a local of a frame the error passes through, as a step's batch is
    refs.append(weakref.ref(step_tensor))
    raise BackwardError(f"out of memory with {step_tensor.numel()} values")


def test_the_errors_finished_frames_let_go_of_their_tensors_and_it_still_prints_the_same() -> None:
    """Whoever keeps the error (ComfyUI, in a reference cycle) no longer keeps the tensors its frames held."""
    refs: list[weakref.ref[torch.Tensor]] = []
    try:
        _raise_with(refs)
    except BackwardError as exc:
        error = exc
    before = traceback.format_exception(error)
    assert refs[0]() is not None  # kept by _raise_with's finished frame, which the traceback holds
    release_error_frames(error)
    assert refs[0]() is None
    assert traceback.format_exception(error) == before  # files, lines, code and message: what ComfyUI shows


def test_the_frames_of_the_errors_it_was_raised_from_are_cleared_too() -> None:
    """An error raised ``from`` another (Train LoRA's out-of-memory hint) or while handling one: their finished
    frames let go of their tensors as well."""
    refs: list[weakref.ref[torch.Tensor]] = []
    try:
        try:
            _raise_with(refs)
        except BackwardError as exc:
            raise RuntimeError("with a hint") from exc
    except RuntimeError as exc:
        error = exc
    assert refs[0]() is not None  # kept by the cause's traceback
    release_error_frames(error)
    assert refs[0]() is None and isinstance(error.__cause__, BackwardError)


def test_clearing_leaves_running_frames_alone_and_never_raises() -> None:
    """The frame handling the error is still running: it keeps its locals and nothing is raised."""
    mine = torch.ones(3)
    try:
        raise BackwardError("here")
    except BackwardError as exc:
        release_error_frames(exc)
    release_error_frames(BackwardError("never raised: no traceback"))
    assert mine.sum() == 3


def _warm_cublas(device: torch.device) -> None:
    """One good pass of every kind the cases run, so that cuBLAS has made its workspace for each thread first.

    cuBLAS keeps a workspace per thread and stream, made through torch's allocator at the thread's first matrix
    product and kept for the thread's life (32 MiB on an H100). The cases' threads are the test's (forward) and the
    device's autograd thread (backward, and a reentrant checkpoint's recompute); without this, R6 counted the
    first case's forward (none, python error) and the first recompute on the autograd thread (fast, python error)
    as 32 MiB the release did not give back."""
    for wrap in ("none", "fast"):
        failing_backward([], lambda grad: grad, wrap, str(device), rows=64)
    torch.cuda.synchronize(device)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("hook", [python_error, engine_error], ids=["python-error", "engine-error"])
@pytest.mark.parametrize("wrap", ["none", "exact", "fast"])
def test_the_failed_graphs_device_memory_comes_back(hook: Callable[[torch.Tensor], torch.Tensor], wrap: str) -> None:
    """On a GPU (where the backward pass runs on the device's own autograd thread): the device memory the failed
    pass held is allocated no more after the release."""
    device = torch.device("cuda")
    _warm_cublas(device)
    before = torch.cuda.memory_allocated(device)
    _failed_step(hook, wrap, "cuda", rows=16384)  # 16 MiB per saved activation
    gc.collect()
    held = torch.cuda.memory_allocated(device) - before
    release_failed_backward([device])
    gc.collect()
    torch.cuda.synchronize(device)
    left = torch.cuda.memory_allocated(device) - before
    assert left <= 1 << 20, f"{left} bytes still allocated after the release ({held} before it)"
