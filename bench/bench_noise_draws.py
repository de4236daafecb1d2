"""What drawing a batch's noise costs a loader worker: plain Gaussian noise, with ``noise_offset``, with
multi-resolution noise (``multires_noise_iterations``) and with the input perturbation (``ip_noise_gamma``: a second
Gaussian draw of the batch's shape), at the latent shapes of the families at 1024² (WAN: 81
frames at 480p).

The draw runs on a loader worker (``StepLoop.per_batch``) while the device trains the batch before, so it costs the
step nothing as long as it stays well under a step's time; this measures how far under it is. The figures are CPU
milliseconds per batch with torch's intra-op threads as the loader worker has them.

    python -m bench.bench_noise_draws            # prints a Markdown table
    python -m bench.bench_noise_draws --smoke    # one tiny shape, one repeat (the CPU test)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dataset_cache.noise_draws import draw_noise, draw_perturbation

__all__ = ["SHAPES", "VARIANTS", "measure", "main"]

SHAPES: dict[str, tuple[int, ...]] = {
    "SD1.5 / SDXL (4×128×128)": (4, 128, 128),
    "Flux / SD3 (16×128×128)": (16, 128, 128),
    "WAN 2.1 clip (16×21×60×104)": (16, 21, 60, 104),
}
"""One row's latent, ``[C, (T,) h, w]``."""
VARIANTS = {
    "plain": (0.0, 0, 0.3, 0.0),
    "noise_offset 0.1": (0.1, 0, 0.3, 0.0),
    "multires 6, 0.3": (0.0, 6, 0.3, 0.0),
    "multires 10, 0.8": (0.0, 10, 0.8, 0.0),
    "ip_noise_gamma 0.1": (0.0, 0, 0.3, 0.1),
}
"""Name -> (noise_offset, multires_noise_iterations, multires_noise_discount, ip_noise_gamma)."""


def _draw(shape: tuple[int, ...], offset: float, iterations: int, discount: float, gamma: float,
          seed: int) -> torch.Tensor:
    """One batch's noise as ``StepLoop._draw`` makes it, and its perturbation as ``StepLoop._perturbation`` does
    (the sigmas left out: a handful of values)."""
    noise = draw_noise(shape, torch.Generator().manual_seed(seed), offset, iterations, discount)
    draw_perturbation(shape, torch.Generator().manual_seed(seed + 1), gamma)
    return noise


def measure(shapes: dict[str, tuple[int, ...]], batches: tuple[int, ...],
            repeat: int) -> list[tuple[str, int, str, float, float, float]]:
    """(shape, batch, variant, median, min, max ms per batch), the variants of a shape and batch interleaved."""
    rows = []
    for name, latent in shapes.items():
        for batch in batches:
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for r in range(repeat):
                for variant, settings in VARIANTS.items():
                    t0 = time.perf_counter()
                    _draw((batch, *latent), *settings, seed=r)
                    times[variant].append((time.perf_counter() - t0) * 1e3)
            rows += [(name, batch, v, statistics.median(t), min(t), max(t)) for v, t in times.items()]
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="one tiny shape, one repeat: checks the harness only")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args(argv)
    smoke: dict[str, tuple[int, ...]] = {"smoke (4×16×16)": (4, 16, 16)}
    shapes, batches, repeat = (smoke, (1,), 1) if args.smoke else (SHAPES, (1, 4), args.repeat)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median (min–max) of {repeat} draws\n")
    print("| latent | batch | noise | ms per batch |")
    print("|---|---:|---|---:|")
    for name, batch, variant, med, lo, hi in measure(shapes, batches, repeat):
        print(f"| {name} | {batch} | {variant} | {med:.1f} ({lo:.1f}–{hi:.1f}) |")


if __name__ == "__main__":
    main()
