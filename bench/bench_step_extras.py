"""What the step's extras cost the training thread: the gradient norm and clipping (``max_grad_norm``) and the
weights' moving average (``ema_decay``), against a per-tensor design, at the LoRA tensor counts of real models.

At batch 1 a GPU step is launch-bound (docs/BENCHMARKS.md, "Ops per training step"): what an extra adds there is
the ops its Python issues per step, which a CPU counts exactly (a dispatch mode sees every op the training thread
dispatches). The time per call is the CPU's, arithmetic included: a rough proxy only.

    python -m bench.bench_step_extras            # prints a Markdown table
    python -m bench.bench_step_extras --smoke    # small tensor counts, one repeat (the CPU test)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dataset_cache.ema import WeightAverage
from dataset_cache.grad_clip import clip_gradients

__all__ = ["LORAS", "count", "count_ops", "lora_params", "lora_sizes", "measure", "main", "optimizer_state_bytes",
           "print_state_table"]

LORAS = {"SD1.5": 1244, "SDXL": 3265}
"""LoRA parameter tensors of a rank-16 LoRA with ComfyUI's adapters (ups, downs, alphas, norm and bias diffs), as
the step-ops counts give them (AdamW's per-parameter step counters: 2,488 and 6,530 host ops a step)."""


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.reads += "_local_scalar_dense" in str(func)  # .item()
        return func(*args, **(kwargs or {}))


@contextmanager
def _counting_tolist(counter: _Counter) -> Iterator[None]:
    """``Tensor.tolist`` reads the tensor's values without a dispatched op: count its calls as reads."""
    original = torch.Tensor.tolist

    def tolist(self: torch.Tensor) -> Any:
        counter.reads += 1
        return original(self)
    torch.Tensor.tolist = tolist  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]


def count(fn: Callable[[], object]) -> tuple[int, int]:
    """(dispatched ops, reads of tensor values into Python) of one call of ``fn``: on a GPU each op is a kernel
    launch or more (or a no-kernel op), each read a synchronization."""
    with _Counter() as counter, _counting_tolist(counter):
        fn()
    return counter.ops, counter.reads


def count_ops(fn: Callable[[], object]) -> int:
    """Dispatcher ops ``fn`` issues (each a kernel launch or more on a GPU, or a no-kernel op)."""
    return count(fn)[0]


def lora_sizes(argv: list[str] | None, description: str, repeat: int) -> tuple[dict[str, int], int]:
    """The command line of a LoRA-step benchmark: the tensor counts to measure (:data:`LORAS`, or 30 with
    ``--smoke``) and the repeats (1 with ``--smoke``)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--smoke", action="store_true", help="30 tensors, one repeat: checks the harness only")
    ap.add_argument("--repeat", type=int, default=repeat)
    args = ap.parse_args(argv)
    return ({"smoke": 30}, 1) if args.smoke else (dict(LORAS), args.repeat)


def lora_params(n: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """``n`` LoRA-like tensors: rank-16 matrices and scalars in turn, each with a gradient."""
    g = torch.Generator().manual_seed(0)
    shapes = [(320, 16), (16, 320), ()]
    params = [torch.nn.Parameter(torch.randn(shapes[i % 3], generator=g).to(dtype)) for i in range(n)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(dtype)
    return params


def optimizer_rows(optimizers: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]], n: int,
                   repeat: int) -> list[tuple[str, str, int, int, float]]:
    """(optimizer, dtype, ops per step, reads per step, CPU ms per step) of each of ``optimizers`` (name → a
    function making it over the parameters) on ``n`` LoRA-like tensors, in fp32 and bf16: the optimizer benchmarks'
    shared loop (``bench_prodigy``, ``bench_lion``). The first step, which makes the state, is not timed."""
    rows = []
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for what, make in optimizers.items():
            opt = make(lora_params(n, dtype))
            opt.step()
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                opt.step()
                times.append((time.perf_counter() - t0) * 1e3)
            ops, reads = count(opt.step)
            rows.append((what, name, ops, reads, statistics.median(times)))
    return rows


def optimizer_state_bytes(makers: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]], n: int,
                          dtype: torch.dtype) -> dict[str, int]:
    """The bytes of state each of ``makers`` keeps for ``n`` LoRA-like tensors after a step (step counts left
    out)."""
    out = {}
    for what, make in makers.items():
        params = lora_params(n, dtype)
        optimizer = make(params)
        optimizer.step()
        out[what] = sum(v.numel() * v.element_size() for s in optimizer.state.values() for k, v in s.items()
                        if k != "step" and isinstance(v, torch.Tensor))
    return out


def print_state_table(argv: list[str] | None, description: str, ours: str, other: str,
                      makers: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]]) -> None:
    """A Markdown table of the state bytes ``makers[ours]`` and ``makers[other]`` keep, per LoRA and dtype."""
    loras, _ = lora_sizes(argv, description, 10)
    print(f"\n| LoRA (tensors) | dtype | state bytes, {ours} | state bytes, {other} | {ours} / {other} |")
    print("|---|---|---:|---:|---:|")
    for model, n in loras.items():
        for dtype in (torch.float32, torch.bfloat16):
            got = optimizer_state_bytes(makers, n, dtype)
            print(f"| {model} ({n:,}) | {str(dtype).removeprefix('torch.')} | {got[ours]:,} | {got[other]:,} | "
                  f"{got[ours] / got[other]:.2f} |")


def print_optimizer_table(argv: list[str] | None, description: str,
                          measure: Callable[[int, int], list[tuple[str, str, int, int, float]]]) -> None:
    """The optimizer benchmarks' command line and Markdown table (``--smoke``, ``--repeat``; :func:`lora_sizes`)."""
    loras, repeat = lora_sizes(argv, description, 10)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {repeat} steps\n")
    print("| LoRA (tensors) | optimizer | dtype | ops per step | value reads per step | CPU ms per step |")
    print("|---|---|---|---:|---:|---:|")
    for model, n in loras.items():
        for what, dtype, ops, reads, ms in measure(n, repeat):
            print(f"| {model} ({n:,}) | {what} | {dtype} | {ops:,} | {reads:,} | {ms:.2f} |")


def _per_tensor_average(average: list[torch.Tensor], params: list[torch.nn.Parameter], weight: float) -> None:
    """The design not taken: a cast per tensor before the fused lerp."""
    torch._foreach_lerp_(average, [p.detach().float() for p in params], weight)


def measure(n: int, repeat: int) -> list[tuple[str, str, int, float]]:
    """(what, dtype, ops per call, CPU ms per call) for ``n`` tensors."""
    rows = []
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        params = lora_params(n, dtype)
        ema = WeightAverage({str(i): p for i, p in enumerate(params)}, 0.99)
        plain = [p.detach().float() for p in params]
        cases: dict[str, Callable[[], object]] = {
            "gradient norm (max_grad_norm 0)": lambda: clip_gradients(params, 0.0),
            "gradient norm + clipping (max_grad_norm 1)": lambda: clip_gradients(params, 1.0),
            "ema_decay: fused cast + lerp (ours)": lambda: ema.update(100),
            "ema_decay: a cast per tensor + lerp": lambda: _per_tensor_average(plain, params, 0.01),
        }
        for what, fn in cases.items():
            if dtype == torch.float32 and "per tensor" in what:
                continue  # an fp32 LoRA needs no cast either way
            fn()  # warm
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            rows.append((what, name, count_ops(fn), statistics.median(times)))
    return rows


def main(argv: list[str] | None = None) -> None:
    loras, repeat = lora_sizes(argv, __doc__.split("\n\n")[0], 20)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {repeat} calls\n")
    print("| LoRA (tensors) | what | dtype | ops per step | CPU ms per step |")
    print("|---|---|---|---:|---:|")
    for model, n in loras.items():
        for what, dtype, ops, ms in measure(n, repeat):
            print(f"| {model} ({n:,}) | {what} | {dtype} | {ops:,} | {ms:.2f} |")


if __name__ == "__main__":
    main()
