"""Replaying the steps ``scripts/bnb8bit_reference.py`` recorded with bitsandbytes, for the 8-bit optimizers' tests:
the same starting weights and gradients through ours, every weight and state tensor compared bit for bit.

Both sides run on ATen's baseline x86-64 kernels (``ATEN_CPU_CAPABILITY=default``: the recording script sets it,
and the replay runs in a child Python with it set). The vectorized kernels ATen picks for a CPU (AVX2, AVX-512)
fuse some multiply-adds (``add_`` with ``alpha``, ``addcdiv_``) and leave others, by vector width, so a step
recorded on one CPU differs from the same step on another by an fp32 rounding of some weights and, where a moment
lies within that rounding of the midpoint between two codes, by a neighbouring 8-bit code. Measured: bitsandbytes'
own AdamW8bit on an AMD EPYC (AVX-512) moved 7 of its 8 fp32 weight tensors up to 3e-8 away from what it had
recorded on the machine that first wrote the files (its moments the same), and on AVX2 its 8-bit moments even
differed from run to run. The baseline kernels have no fused multiply-add (x86-64's baseline has no FMA
instruction), so every operation is one IEEE rounding of the same operands on every x86-64 CPU: there, bitsandbytes
repeats itself exactly, ours equals it exactly, and the comparison stays exact.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

DATA = Path(__file__).resolve().parent.parent / "unit" / "data"
BASELINE = "DEFAULT"
"""ATen's name for its baseline kernels (``torch.backends.cpu.get_cpu_capability()``)."""


def replay_and_compare(cls: type, optimizer: str, run: str, dtype: torch.dtype, default_betas: tuple[float, float],
                       small: dict[str, str], quantized: dict[str, str]) -> tuple[int, int]:
    """Step ``cls`` through ``optimizer``'s recorded ``run`` with weights of ``dtype`` on the baseline kernels
    and assert every weight and state slot equals bitsandbytes' (``small`` and ``quantized``: bitsandbytes' slot
    names → ours, for the tensors with fp32 and with 8-bit moments) and each tensor's step count; return how many
    weights the steps moved, of how many. Every run of ``optimizer`` is replayed in one child Python (unless this
    one runs on the baseline kernels), the first time one is asked for."""
    key = f"{run}/{str(dtype).removeprefix('torch.')}"
    outcome = _replayed(f"{cls.__module__}:{cls.__qualname__}", optimizer, tuple(default_betas),
                        json.dumps([small, quantized]))[key]
    assert not isinstance(outcome, str), outcome
    return outcome[0], outcome[1]


@functools.cache
def _replayed(cls_name: str, optimizer: str, default_betas: tuple[float, float],
              slots: str) -> dict[str, list[int] | str]:
    """Each recorded run's ``[moved, weights]``, or the assertion that failed it (see :func:`_replay_all`)."""
    args = [cls_name, optimizer, list(default_betas), *json.loads(slots)]
    if torch.backends.cpu.get_cpu_capability() == BASELINE:
        return _replay_all(*args)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": BASELINE.lower(), "PYTHONPATH": os.pathsep.join(sys.path)}
    code = ("import json, sys; from support.bnb_reference import _replay_all; "
            "print(json.dumps(_replay_all(*json.loads(sys.argv[1]))))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(args)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, f"the replay on the baseline kernels failed:\n{done.stdout}\n{done.stderr}"
    out: dict[str, list[int] | str] = json.loads(done.stdout.splitlines()[-1])
    return out


def _replay_all(cls_name: str, optimizer: str, default_betas: list[float], small: dict[str, str],
                quantized: dict[str, str]) -> dict[str, list[int] | str]:
    """Replay every recorded run with fp32 and bf16 weights (here: on the baseline kernels)."""
    capability = torch.backends.cpu.get_cpu_capability()
    assert capability == BASELINE, f"the replay must run on ATen's baseline kernels, not {capability}"
    module, _, name = cls_name.partition(":")
    cls = getattr(importlib.import_module(module), name)
    with safe_open(str(DATA / f"{optimizer.lower()}-reference-v1.safetensors"), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())
    assert meta.get("cpu_capability") == BASELINE, "the reference was not recorded on the baseline kernels"
    out: dict[str, list[int] | str] = {}
    for run in json.loads(meta["runs"]):
        for dtype in (torch.float32, torch.bfloat16):
            key = f"{run}/{str(dtype).removeprefix('torch.')}"
            try:
                out[key] = list(_replay(cls, tensors, meta, run, dtype, tuple(default_betas), small, quantized))
            except AssertionError as exc:
                out[key] = f"{key} differs from bitsandbytes: {exc}"
    return out


def _replay(cls: type, tensors: dict[str, torch.Tensor], meta: dict[str, str], run: str, dtype: torch.dtype,
            default_betas: tuple[float, float], small: dict[str, str], quantized: dict[str, str]) -> tuple[int, int]:
    shapes, steps = json.loads(meta["shapes"]), int(meta["steps"])
    settings: dict[str, Any] = json.loads(meta["runs"])[run]
    params = [torch.nn.Parameter(tensors[f"start/{i}"].to(dtype, copy=True)) for i in range(len(shapes))]
    stepper = cls(params, **{**settings, "betas": tuple(settings.get("betas", default_betas))})
    for t in range(steps):
        for i, p in enumerate(params):
            p.grad = tensors[f"grad/{t}/{i}"].to(dtype)
        stepper.step()
    name = f"{run}/{str(dtype).removeprefix('torch.')}"
    moved = 0
    for i, p in enumerate(params):
        assert torch.equal(p.detach(), tensors[f"{name}/param/{i}"]), (name, shapes[i])
        moved += int((p.detach() != tensors[f"start/{i}"].to(dtype)).sum())
        state = stepper.state[p]
        names = small if set(small.values()) <= set(state) else quantized
        for theirs, ours in names.items():
            assert torch.equal(state[ours], tensors[f"{name}/{theirs}/{i}"]), (name, shapes[i], ours)
        assert state["step"] == steps
    return moved, sum(torch.Size(shape).numel() for shape in shapes)
