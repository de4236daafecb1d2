"""Write the reference steps ``tests/unit/test_adamw8bit.py`` and ``tests/unit/test_lion8bit.py`` check
``dataset_cache.adamw8bit`` and ``dataset_cache.lion8bit`` against: ``bitsandbytes.optim.AdamW8bit`` and
``Lion8bit`` on the CPU with bitsandbytes' PyTorch quantizer.

Run it in a Python that has ``bitsandbytes`` and ``torch`` (not the pack's test venv: bitsandbytes is no dependency)::

    python scripts/bnb8bit_reference.py                        # both files
    python scripts/bnb8bit_reference.py --optimizer Lion8bit   # one

bitsandbytes' compiled CPU library rounds a moment to a code by a binary search that can land a code or two from the
nearest; its PyTorch quantizer, which bitsandbytes uses where the library is missing, rounds to the nearest, as ours
does. So the package is copied to a temporary folder without its compiled libraries and imported from there. The
starting weights and the gradients are bf16 values (exact in fp32), stored with the results, so the test needs
neither bitsandbytes nor a random generator that is the same on every CPU.

Everything runs on ATen's baseline x86-64 kernels (``ATEN_CPU_CAPABILITY=default``, set here before torch is
imported), as the tests' replay does: the kernels ATen picks for a CPU (AVX2, AVX-512) round some multiply-adds
differently from one CPU to another, the baseline ones round every operation once on every x86-64 CPU
(``tests/support/bnb_reference.py`` has the measurements).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ["ATEN_CPU_CAPABILITY"] = "default"  # before torch is imported: it reads it once

DATA = Path(__file__).resolve().parent.parent / "tests" / "unit" / "data"
SHAPES = ((24, 256), (70, 61), (16, 32), (8,))
"""8-bit whole blocks; 8-bit with a partial last block; fp32 moments (under 4,096 elements); a vector."""
STEPS = 3
RUNS = {
    "AdamW8bit": {
        "defaults": {"lr": 1e-3},
        "decay": {"lr": 3e-2, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1},
    },
    "Lion8bit": {  # lr 1e-3: its default 1e-4 moves few bf16 weights of 0.1 (their resolution is 4e-4)
        "defaults": {"lr": 1e-3},
        "decay": {"lr": 3e-2, "betas": [0.8, 0.95], "weight_decay": 0.1},
    },
}
"""Per bitsandbytes optimizer, the runs recorded (each with fp32 and bf16 weights)."""
DEFAULT_BETAS = {"AdamW8bit": (0.9, 0.999), "Lion8bit": (0.9, 0.99)}


def reference_path(optimizer: str) -> Path:
    """The file of ``optimizer``'s reference steps."""
    return DATA / f"{optimizer.lower()}-reference-v1.safetensors"


def _bitsandbytes_without_library(tmp: Path) -> object:
    """The installed bitsandbytes, imported from a copy without its compiled libraries."""
    spec = importlib.util.find_spec("bitsandbytes")
    if spec is None or spec.origin is None:
        raise SystemExit("bitsandbytes is not installed in this Python: pip install bitsandbytes")
    copy = tmp / "bitsandbytes"
    shutil.copytree(Path(spec.origin).parent, copy, ignore=shutil.ignore_patterns("*.so", "*.dll", "*.dylib"))
    sys.path.insert(0, str(tmp))
    import bitsandbytes

    if not str(bitsandbytes.__file__).startswith(str(tmp)):
        raise SystemExit(f"imported {bitsandbytes.__file__}, not the copy in {tmp}")
    return bitsandbytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=sorted(RUNS), action="append",
                        help="the optimizer to record (repeatable; default: every one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        bnb = _bitsandbytes_without_library(Path(tmp))
        for optimizer in args.optimizer or sorted(RUNS):
            _record(bnb, optimizer, reference_path(optimizer))
    return 0


def _record(bnb: Any, optimizer: str, out: Path) -> None:
    """Run ``optimizer``'s :data:`RUNS` and write the inputs and results to ``out``."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(8)
    tensors: dict[str, torch.Tensor] = {}
    for i, shape in enumerate(SHAPES):
        tensors[f"start/{i}"] = (torch.randn(shape, generator=g) * 0.1).to(torch.bfloat16)
        for t in range(STEPS):
            tensors[f"grad/{t}/{i}"] = (torch.randn(shape, generator=g) * 10.0 ** -(t % 3)).to(torch.bfloat16)
    for dtype in (torch.float32, torch.bfloat16):
        for run, settings in RUNS[optimizer].items():
            params = [torch.nn.Parameter(tensors[f"start/{i}"].to(dtype, copy=True)) for i in range(len(SHAPES))]
            betas = tuple(settings.get("betas", DEFAULT_BETAS[optimizer]))
            stepper = getattr(bnb.optim, optimizer)(params, **{**settings, "betas": betas})
            for t in range(STEPS):
                for i, p in enumerate(params):
                    p.grad = tensors[f"grad/{t}/{i}"].to(dtype)
                stepper.step()
            name = f"{run}/{str(dtype).removeprefix('torch.')}"
            for i, p in enumerate(params):
                tensors[f"{name}/param/{i}"] = p.detach().clone()
                for slot, value in stepper.state[p].items():
                    if isinstance(value, torch.Tensor) and not slot.startswith("qmap"):
                        tensors[f"{name}/{slot}/{i}"] = value.clone()
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "DEFAULT":
        raise SystemExit(f"torch runs on its {capability} kernels, not the baseline ones: was it imported earlier?")
    meta = {"bitsandbytes": bnb.__version__, "torch": torch.__version__, "steps": str(STEPS),
            "shapes": json.dumps(SHAPES), "runs": json.dumps(RUNS[optimizer]), "cpu_capability": capability}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out), metadata=meta)
    print(f"wrote {out} ({out.stat().st_size:,} bytes): bitsandbytes {meta['bitsandbytes']}, torch {meta['torch']}")

if __name__ == "__main__":
    raise SystemExit(main())
