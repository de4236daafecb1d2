"""What a Lion step costs the training thread: ours (``dataset_cache/lion.py``) against the ``lion-pytorch`` package
kohya's and ai-toolkit's ``Lion`` is, at the LoRA tensor counts of real models.

As for Prodigy (``bench/bench_prodigy.py``): at batch 1 a GPU step is launch-bound, so what an optimizer costs there
is the ops its Python dispatches per step, which a CPU counts exactly; the CPU milliseconds include the arithmetic,
a rough proxy only.

    python -m bench.bench_lion            # prints a Markdown table (needs lion-pytorch, the reference)
    python -m bench.bench_lion --smoke    # 30 tensors, one repeat (the CPU test)
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.bench_step_extras import count, lora_params, lora_sizes
from dataset_cache.lion import Lion

__all__ = ["measure", "main"]


def _optimizers() -> dict[str, type]:
    out: dict[str, type] = {"ours (dataset_cache.lion)": Lion}
    try:
        import lion_pytorch
    except ImportError:
        return out
    out["lion-pytorch 0.2 (the reference)"] = lion_pytorch.Lion
    return out


def measure(n: int, repeat: int) -> list[tuple[str, str, int, int, float]]:
    """(optimizer, dtype, ops per step, reads per step, CPU ms per step) for ``n`` tensors."""
    rows = []
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for what, cls in _optimizers().items():
            opt = cls(lora_params(n, dtype), lr=1e-4)
            opt.step()  # the first step makes the state
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                opt.step()
                times.append((time.perf_counter() - t0) * 1e3)
            ops, reads = count(opt.step)
            rows.append((what, name, ops, reads, statistics.median(times)))
    return rows


def main(argv: list[str] | None = None) -> None:
    loras, repeat = lora_sizes(argv, __doc__.split("\n\n")[0], 10)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {repeat} steps\n")
    print("| LoRA (tensors) | optimizer | dtype | ops per step | value reads per step | CPU ms per step |")
    print("|---|---|---|---:|---:|---:|")
    for model, n in loras.items():
        for what, dtype, ops, reads, ms in measure(n, repeat):
            print(f"| {model} ({n:,}) | {what} | {dtype} | {ops:,} | {reads:,} | {ms:.2f} |")


if __name__ == "__main__":
    main()
