"""What an Adafactor step costs the training thread: ours (``dataset_cache/adafactor.py``) against
``transformers.optimization.Adafactor`` (kohya's and FluxGym's) and torch's AdamW, at the LoRA tensor counts of real
models.

As for Prodigy and Lion (``bench/bench_prodigy.py``, ``bench/bench_lion.py``): at batch 1 a GPU step is
launch-bound, so what an optimizer costs there is the ops its Python dispatches per step, which a CPU counts; the CPU
milliseconds include the arithmetic, a rough proxy only. One caveat the count cannot show: a fused op over tensors
of different shapes with a tensor per tensor as its other operand (ours divides each update by its own clip scale)
is one op here but one kernel per tensor on a GPU, where torch's fused kernels take only same-shaped lists.

    python -m bench.bench_adafactor            # prints a Markdown table (the reference needs transformers:
                                               # run it with ComfyUI's python, which has it)
    python -m bench.bench_adafactor --smoke    # 30 tensors, one repeat (the CPU test)
"""

from __future__ import annotations

from typing import Any

import torch

from bench.bench_step_extras import optimizer_rows, print_optimizer_table
from dataset_cache.adafactor import Adafactor

__all__ = ["KOHYA", "measure", "main"]

KOHYA: dict[str, Any] = {"lr": 1e-4, "relative_step": False, "scale_parameter": False, "warmup_init": False}
"""kohya's and FluxGym's settings (Train LoRA's default for ``optimizer`` Adafactor)."""


def _optimizers() -> dict[str, Any]:
    out: dict[str, Any] = {
        "ours, kohya's settings": lambda params: Adafactor(params, **KOHYA),
        "ours, scale_parameter": lambda params: Adafactor(params, **{**KOHYA, "scale_parameter": True}),
        "AdamW (torch, fused over tensors as on a GPU)": lambda params: torch.optim.AdamW(params, lr=1e-4,
                                                                                          foreach=True),
    }
    try:
        from transformers.optimization import Adafactor as Reference
    except ImportError:
        return out
    out["transformers, kohya's settings (the reference)"] = lambda params: Reference(params, **KOHYA)
    return out


def measure(n: int, repeat: int) -> list[tuple[str, str, int, int, float]]:
    """(optimizer, dtype, ops per step, reads per step, CPU ms per step) for ``n`` tensors."""
    return optimizer_rows(_optimizers(), n, repeat)


def main(argv: list[str] | None = None) -> None:
    print_optimizer_table(argv, __doc__.split("\n\n")[0], measure)


if __name__ == "__main__":
    main()
