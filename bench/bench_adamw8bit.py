"""What an AdamW8bit step costs the training thread: ours (``dataset_cache/adamw8bit.py``) against torch's AdamW
and, where it is installed, ``bitsandbytes.optim.AdamW8bit`` (kohya's and ai-toolkit's), at the LoRA tensor counts
of real models; and the bytes each keeps.

As for the other optimizers (``bench/bench_adafactor.py``): at batch 1 a GPU step is launch-bound, so what an
optimizer costs there is the ops its Python dispatches per step, which a CPU counts; the CPU milliseconds include
the arithmetic, a rough proxy only. bitsandbytes' CPU path dispatches about fifteen ops per tensor; on a GPU it runs
one fused kernel per tensor, so its row here says nothing of its GPU cost, which is one kernel per tensor.

    python -m bench.bench_adamw8bit            # prints a Markdown table
    python -m bench.bench_adamw8bit --smoke    # 30 tensors, one repeat (the CPU test)
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from bench.bench_step_extras import optimizer_rows, optimizer_state_bytes, print_optimizer_table, print_state_table
from dataset_cache.adamw8bit import AdamW8bit

__all__ = ["MAKERS", "measure", "main", "state_bytes"]


def _optimizers() -> dict[str, Any]:
    out: dict[str, Any] = {
        "ours": lambda params: AdamW8bit(params, lr=1e-4),
        "AdamW (torch, fused over tensors as on a GPU)": lambda params: torch.optim.AdamW(params, lr=1e-4,
                                                                                          foreach=True),
    }
    try:
        import bitsandbytes
    except ImportError:
        return out
    out["bitsandbytes (its CPU path)"] = lambda params: bitsandbytes.optim.AdamW8bit(params, lr=1e-4)
    return out


def measure(n: int, repeat: int) -> list[tuple[str, str, int, int, float]]:
    """(optimizer, dtype, ops per step, reads per step, CPU ms per step) for ``n`` tensors."""
    return optimizer_rows(_optimizers(), n, repeat)


MAKERS = {"ours": lambda p: AdamW8bit(p), "AdamW": lambda p: torch.optim.AdamW(p, foreach=True)}
"""The state table's optimizers (torch's AdamW keeps its moments in the weights' dtype)."""


def state_bytes(n: int, dtype: torch.dtype) -> dict[str, int]:
    """The bytes of state ours and torch's AdamW keep for ``n`` LoRA-like tensors after a step (the step counts
    left out)."""
    return optimizer_state_bytes(MAKERS, n, dtype)


def main(argv: list[str] | None = None) -> None:
    print_optimizer_table(argv, __doc__.split("\n\n")[0], measure)
    print_state_table(argv, __doc__.split("\n\n")[0], "ours", "AdamW", MAKERS)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
