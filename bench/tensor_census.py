"""What Python still reaches of a device's memory: the tensors on it that the cyclic collector can see, and what
refers to them. Memory allocated on the device that none of these accounts for is held by C++ alone (autograd's
engine, a cycle through C++ objects); used by the GPU harness for an arm that kept memory
(:mod:`bench.gpu_train`) and by the failed-backward probe (``tests/support/release_probe.py``)."""

from __future__ import annotations

import gc
import warnings
from collections import Counter
from typing import Any

__all__ = ["storage_bytes", "device_tensors", "census", "device_census"]

GIB = 1 << 30


def storage_bytes(t: Any) -> int:
    """Bytes of the storage under ``t``; 0 for what has none to read (sparse, nested, some tensor subclasses)."""
    import torch

    if t.layout != torch.strided:
        return 0
    try:
        return int(t.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError):
        return 0


def device_tensors(device: Any, min_bytes: int = 0) -> list[Any]:
    """The tensors on ``device``'s type whose storage holds ``min_bytes`` or more, after a collection."""
    import torch

    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some of torch's deprecated module attributes warns
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type == device.type
                and (storage_bytes(o) >= min_bytes if min_bytes else o.layout == torch.strided)]


def census(device: Any, largest: int = 16) -> tuple[int, int, Counter[str]]:
    """(bytes, tensors, bytes by the type of each referrer) of the strided tensors on ``device`` gc reaches; the
    referrers of the ``largest`` ones only (each lookup walks every object of the process: ComfyUI's ~400,000)."""
    found = device_tensors(device)
    sizes = {id(t): storage_bytes(t) for t in found}
    by: Counter[str] = Counter()
    ranked = sorted(found, key=lambda t: sizes[id(t)], reverse=True)
    top = ranked[:largest]
    own = {id(found), id(ranked), id(top)}
    for t in top:
        for ref in gc.get_referrers(t):
            if id(ref) not in own:
                by[type(ref).__name__] += sizes[id(t)]
    return sum(sizes.values()), len(found), by


def device_census(device: Any, top: int = 4) -> str:
    """The tensors on ``device`` that Python's gc reaches, and the largest ones' GiB by the type of what refers to
    them (largest first), e.g. ``2.0 GiB in 14 tensors (frame 1.5, dict 0.5)``: what an arm kept that Python
    holds, so the rest of what it kept is held by C++ alone (autograd's engine, a C++ cycle)."""
    total, count, by = census(device)
    parts = ", ".join(f"{name} {n / GIB:.1f}" for name, n in by.most_common(top))
    return f"{total / GIB:.1f} GiB in {count} tensors" + (f" ({parts})" if parts else "")
