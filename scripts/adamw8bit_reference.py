"""Write the reference steps ``tests/unit/test_adamw8bit.py`` checks ``dataset_cache.adamw8bit`` against:
``bitsandbytes.optim.AdamW8bit`` on the CPU with bitsandbytes' PyTorch quantizer.

Run it in a Python that has ``bitsandbytes`` and ``torch`` (not the pack's test venv: bitsandbytes is no dependency)::

    python scripts/adamw8bit_reference.py

bitsandbytes' compiled CPU library rounds a moment to a code by a binary search that can land a code or two from the
nearest; its PyTorch quantizer, which bitsandbytes uses where the library is missing, rounds to the nearest, as ours
does. So the package is copied to a temporary folder without its compiled libraries and imported from there. The
starting weights and the gradients are bf16 values (exact in fp32), stored with the results, so the test needs
neither bitsandbytes nor a random generator that is the same on every CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "unit" / "data" / "adamw8bit-reference-v1.safetensors"
SHAPES = ((24, 256), (70, 61), (16, 32), (8,))
"""8-bit whole blocks; 8-bit with a partial last block; fp32 moments (under 4,096 elements); a vector."""
STEPS = 3
RUNS = {
    "defaults": {"lr": 1e-3},
    "decay": {"lr": 3e-2, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1},
}


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
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    import torch
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        bnb = _bitsandbytes_without_library(Path(tmp))
        g = torch.Generator().manual_seed(8)
        tensors: dict[str, torch.Tensor] = {}
        for i, shape in enumerate(SHAPES):
            tensors[f"start/{i}"] = (torch.randn(shape, generator=g) * 0.1).to(torch.bfloat16)
            for t in range(STEPS):
                tensors[f"grad/{t}/{i}"] = (torch.randn(shape, generator=g) * 10.0 ** -(t % 3)).to(torch.bfloat16)
        for dtype in (torch.float32, torch.bfloat16):
            for run, settings in RUNS.items():
                params = [torch.nn.Parameter(tensors[f"start/{i}"].to(dtype, copy=True))
                          for i in range(len(SHAPES))]
                optimizer = bnb.optim.AdamW8bit(params, **{**settings, "betas": tuple(settings.get("betas",
                                                                                                   (0.9, 0.999)))})
                for t in range(STEPS):
                    for i, p in enumerate(params):
                        p.grad = tensors[f"grad/{t}/{i}"].to(dtype)
                    optimizer.step()
                name = f"{run}/{str(dtype).removeprefix('torch.')}"
                for i, p in enumerate(params):
                    tensors[f"{name}/param/{i}"] = p.detach().clone()
                    for slot, value in optimizer.state[p].items():
                        if isinstance(value, torch.Tensor) and not slot.startswith("qmap"):
                            tensors[f"{name}/{slot}/{i}"] = value.clone()
        meta = {"bitsandbytes": bnb.__version__, "torch": torch.__version__, "steps": str(STEPS),
                "shapes": json.dumps(SHAPES), "runs": json.dumps(RUNS)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(args.out), metadata=meta)
    print(f"wrote {args.out} ({args.out.stat().st_size:,} bytes): bitsandbytes {meta['bitsandbytes']}, "
          f"torch {meta['torch']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
