"""What a backward pass that failed on a CUDA device leaves allocated, and which step gives it back: a diagnostic
for a GPU session (``scripts/device-run`` runs it after the CUDA tests; by hand: ``python
tests/support/release_probe.py``).

Why: on the H100 (R6) the release test's CUDA cases found 32 MiB still allocated after the release in two of six
cases: the first case (an error raised in Python, no checkpoint) and the first with a reentrant checkpoint's
recompute. Those are the first matrix product of the test's thread and of the device's autograd thread, where
cuBLAS makes the workspace it keeps for the thread's life (32 MiB on an H100) through torch's allocator; the test
now runs one good pass of each kind first. The probe reports what that warm-up allocates and what clearing cuBLAS's
workspaces gives back, then, for each of the six cases, what stayed allocated after the failure and what each
further step gives back, in order: waiting (a device thread still finishing), clearing the error's traceback
frames, dropping the error, the release, a collection, a backward pass that runs a Python hook on the device's
autograd thread, a whole successful backward pass of the same shape through a reentrant checkpoint (a backward
pass nested in the device thread's), and one without; and, once the error is dropped and at the end, the tensors of
the failed pass's size that Python's gc still reaches, with what refers to each ("nothing in Python": only C++
holds it, e.g. autograd's engine).
"""

from __future__ import annotations

import gc
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from bench.tensor_census import device_tensors  # noqa: E402
from dataset_cache.autograd_release import release_error_frames, release_failed_backward  # noqa: E402
from support.failed_backward import engine_error, failing_backward, python_error  # noqa: E402

MIB = 1 << 20
ROWS = 16384  # 16 MiB per saved activation of failing_backward's 256 columns


def _allocated(device: torch.device) -> int:
    """Bytes allocated on ``device``; 0 on the CPU, where the probe only checks itself (the tests run it there)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _referrers(obj: object, own: set[int]) -> list[str]:
    names = []
    for ref in gc.get_referrers(obj):
        if id(ref) in own:
            continue
        if isinstance(ref, type(sys._getframe())):
            names.append(f"frame {ref.f_code.co_name}")
        elif isinstance(ref, dict):
            names.append(f"dict({len(ref)})")
        else:
            names.append(type(ref).__name__)
    return names


def _reachable(device: torch.device, min_bytes: int, before: list[torch.Tensor]) -> list[str]:
    """The tensors of ``min_bytes`` or more on ``device`` that were not there ``before``, with what refers to each."""
    known = {id(t) for t in before}
    found = [t for t in device_tensors(device, min_bytes) if id(t) not in known]
    own = {id(found), id(before), id(sys._getframe())}
    return [f"{tuple(t.shape)} {str(t.dtype)[6:]} <- {', '.join(_referrers(t, own)) or 'nothing in Python'}"
            for t in found]


def _python_hook_release(device: torch.device) -> None:
    leaf = torch.ones(1, device=device, requires_grad=True)
    out = leaf * 2.0
    out.register_hook(lambda g: g)
    out.sum().backward()


def _good_backward(device: torch.device, rows: int, wrap: str = "none") -> None:
    refs: list[weakref.ref[torch.Tensor]] = []
    failing_backward(refs, lambda g: g, wrap, str(device), rows)


def probe(hook: Callable[[torch.Tensor], torch.Tensor], wrap: str, device: torch.device, rows: int = ROWS) -> str:
    """One case: fail a backward pass, then report what each step gives back (MiB still allocated after it)."""
    min_bytes = rows * 256 * 4 // 2
    before = device_tensors(device, min_bytes)  # held to the end, so no new tensor can take one of their ids
    base = _allocated(device)
    refs: list[weakref.ref[torch.Tensor]] = []
    error: BaseException | None = None
    try:
        failing_backward(refs, hook, wrap, str(device), rows)
    except RuntimeError as exc:
        error = exc
    steps: list[tuple[str, float]] = [("failed", (_allocated(device) - base) / MIB)]
    time.sleep(0.2)
    steps.append(("after 0.2 s", (_allocated(device) - base) / MIB))
    if error is not None:
        release_error_frames(error)  # what Train LoRA does as the error leaves the node
        steps.append(("frames cleared", (_allocated(device) - base) / MIB))
    error = None
    gc.collect()
    steps.append(("error dropped", (_allocated(device) - base) / MIB))
    reachable = _reachable(device, min_bytes, before)
    release_failed_backward([device])
    steps.append(("release", (_allocated(device) - base) / MIB))
    gc.collect()
    steps.append(("gc", (_allocated(device) - base) / MIB))
    _python_hook_release(device)
    steps.append(("python-hook backward", (_allocated(device) - base) / MIB))
    _good_backward(device, rows, "fast")
    gc.collect()
    steps.append(("good reentrant backward", (_allocated(device) - base) / MIB))
    _good_backward(device, rows)
    gc.collect()
    steps.append(("good backward", (_allocated(device) - base) / MIB))
    alive = refs[0]() is not None if refs else None
    left = _reachable(device, min_bytes, before)
    return (f"{wrap}/{hook.__name__}: " + "; ".join(f"{name} {mib:.1f}" for name, mib in steps)
            + f" MiB; saved activation alive at the end: {alive}\n    reachable once the error was dropped: "
            + ("; ".join(reachable) or "none") + "\n    reachable at the end: " + ("; ".join(left) or "none"))


def _warm_up(device: torch.device) -> str:
    """One good pass without and one with a reentrant checkpoint (the test's thread and the autograd thread each
    run a matrix product); what that left allocated, and what clearing cuBLAS's workspaces gives back of it."""
    base = _allocated(device)
    for wrap in ("none", "fast"):
        _good_backward(device, 64, wrap)
    gc.collect()
    warm = (_allocated(device) - base) / MIB
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return f"warm-up: {warm:.1f} MiB left allocated (this torch cannot clear cuBLAS's workspaces)"
    clear()
    cleared = (_allocated(device) - base) / MIB
    for wrap in ("none", "fast"):  # the cases start warm, as the CUDA test's do
        _good_backward(device, 64, wrap)
    return (f"warm-up: {warm:.1f} MiB left allocated by one good pass without and one with a reentrant checkpoint; "
            f"{cleared:.1f} MiB after clearing cuBLAS's workspaces; warm again for the cases")


def main() -> int:
    if not torch.cuda.is_available():
        print("release probe: no CUDA device, nothing to probe")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"release probe: torch {torch.__version__}, Python {sys.version.split()[0]}, "
          f"{torch.cuda.get_device_name(device)}")
    print(_warm_up(device), flush=True)
    for wrap in ("none", "exact", "fast"):  # the CUDA test's order
        for hook in (python_error, engine_error):
            try:
                print(probe(hook, wrap, device), flush=True)
            except Exception as exc:  # a probe that breaks says how, and the others still run
                print(f"{wrap}/{hook.__name__}: probe failed: {type(exc).__name__}: {exc}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
