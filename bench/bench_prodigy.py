"""What a Prodigy step costs the training thread: ours (``dataset_cache/prodigy.py``) against the ``prodigyopt``
package LoRA trainers use, at the LoRA tensor counts of real models.

At batch 1 a GPU step is launch-bound (docs/BENCHMARKS.md, "Ops per training step"), and a read of a device value
(``.item()``, ``.tolist()``) stalls the host until the device catches up: what an optimizer costs there is the ops
its Python dispatches and the reads it makes per step, which a CPU counts exactly. The CPU milliseconds include the
arithmetic: a rough proxy only. ``tests/unit/test_prodigy_cuda.py`` counts the synchronizations on a GPU.

    python -m bench.bench_prodigy            # prints a Markdown table (needs prodigyopt, the reference)
    python -m bench.bench_prodigy --smoke    # 30 tensors, one repeat (the CPU test)
"""

from __future__ import annotations

from typing import Any

from bench.bench_step_extras import optimizer_rows, print_optimizer_table
from dataset_cache.prodigy import Prodigy

__all__ = ["measure", "main"]


def _optimizers() -> dict[str, Any]:
    out: dict[str, Any] = {"ours (dataset_cache.prodigy)": lambda params: Prodigy(params, weight_decay=0.01)}
    try:
        import prodigyopt
    except ImportError:
        return out
    out["prodigyopt 1.1 (the reference)"] = lambda params: prodigyopt.Prodigy(params, weight_decay=0.01)
    return out


def measure(n: int, repeat: int) -> list[tuple[str, str, int, int, float]]:
    """(optimizer, dtype, ops per step, reads per step, CPU ms per step) for ``n`` tensors."""
    return optimizer_rows(_optimizers(), n, repeat)


def main(argv: list[str] | None = None) -> None:
    print_optimizer_table(argv, __doc__.split("\n\n")[0], measure)


if __name__ == "__main__":
    main()
