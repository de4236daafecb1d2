"""What a Lion step costs the training thread: ours (``dataset_cache/lion.py``) against the ``lion-pytorch`` package
kohya's and ai-toolkit's ``Lion`` is, and our Lion8bit (``dataset_cache/lion8bit.py``, bitsandbytes' ``Lion8bit``),
at the LoRA tensor counts of real models; and the bytes Lion8bit and Lion keep.

As for Prodigy (``bench/bench_prodigy.py``): at batch 1 a GPU step is launch-bound, so what an optimizer costs there
is the ops its Python dispatches per step, which a CPU counts exactly; the CPU milliseconds include the arithmetic,
a rough proxy only.

    python -m bench.bench_lion            # prints a Markdown table (needs lion-pytorch, the reference)
    python -m bench.bench_lion --smoke    # 30 tensors, one repeat (the CPU test)
"""

from __future__ import annotations

import sys
from typing import Any

from bench.bench_step_extras import optimizer_rows, print_optimizer_table, print_state_table
from dataset_cache.lion import Lion
from dataset_cache.lion8bit import Lion8bit

__all__ = ["MAKERS", "measure", "main"]


def _optimizers() -> dict[str, Any]:
    out: dict[str, Any] = {"ours (dataset_cache.lion)": lambda params: Lion(params, lr=1e-4),
                           "Lion8bit (dataset_cache.lion8bit)": lambda params: Lion8bit(params, lr=1e-4)}
    try:
        import lion_pytorch
    except ImportError:
        return out
    out["lion-pytorch 0.2 (the reference)"] = lambda params: lion_pytorch.Lion(params, lr=1e-4)
    return out


def measure(n: int, repeat: int) -> list[tuple[str, str, int, int, float]]:
    """(optimizer, dtype, ops per step, reads per step, CPU ms per step) for ``n`` tensors."""
    return optimizer_rows(_optimizers(), n, repeat)


MAKERS = {"Lion8bit": lambda p: Lion8bit(p), "Lion": lambda p: Lion(p)}
"""The state table's optimizers (Lion keeps its moment in the weights' dtype)."""


def main(argv: list[str] | None = None) -> None:
    print_optimizer_table(argv, __doc__.split("\n\n")[0], measure)
    print_state_table(argv, __doc__.split("\n\n")[0], "Lion8bit", "Lion", MAKERS)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
