"""Benchmark: what writing a LoRA's training metadata costs a save (Save LoRA (Stream Cache), ``save_every``).

A save already serializes the LoRA once (what Save LoRA Weights does); the metadata adds its content hashes: one
more serialization with the ``ss_*`` keys (kohya's legacy hash reads that file's bytes) and a SHA-256 over the tensor
bytes. Side by side in one run, medians of ``--runs``: the plain serialization, the metadata (hashes), and both, for
LoRAs of SD1.5-, SDXL- and Flux-like sizes in bf16 (no file is written: the disk would hide what the hashes cost).

    .venv/bin/python -m bench.bench_lora_metadata            # from the pack root
    .venv/bin/python -m bench.bench_lora_metadata --runs 7
"""

from __future__ import annotations

import argparse
import time
import safetensors.torch
import torch

from bench.bench_incremental import median_time
from dataset_cache.lora_metadata import architecture_of, file_metadata, training_metadata

__all__ = ["main"]

SIZES_MB = {"SD1.5 rank 32 (~38 MB)": 38, "SDXL rank 32 (~220 MB)": 220, "Flux rank 64 (~640 MB)": 640}
"""bf16 LoRA sizes of common ranks (kohya's files of those families and ranks weigh about so much)."""


def _lora(megabytes: int) -> dict[str, torch.Tensor]:
    """Adapter pairs of 3072-wide layers in bf16 adding up to about ``megabytes``."""
    pair = 2 * 3072 * 64 * 2  # down and up, bf16
    count = max(1, megabytes * 2**20 // pair)
    gen = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for i in range(count):
        out[f"diffusion_model.b{i}.lora_down.weight"] = torch.randn(64, 3072, generator=gen).bfloat16()
        out[f"diffusion_model.b{i}.lora_up.weight"] = torch.randn(3072, 64, generator=gen).bfloat16()
        out[f"diffusion_model.b{i}.alpha"] = torch.tensor(64.0)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    training = training_metadata(arch=architecture_of("Flux", False), v_prediction=False,
                                 settings={"rank": 64, "lora_alpha": 64.0}, resolution=None, dataset_dirs={},
                                 train_images=0, reg_images=0, tag_frequency={"f": {f"t{i}": 1 for i in range(1000)}},
                                 started_at=time.time(), version="bench")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians of {args.runs} runs")
    print(f"{'LoRA':<26} {'plain save':>11} {'metadata':>10} {'both':>9} {'both / plain':>13}")
    for label, megabytes in SIZES_MB.items():
        lora = _lora(megabytes)
        plain = median_time(lambda: safetensors.torch.save(lora), args.runs)
        meta = median_time(lambda: file_metadata(lora, training, title="bench", saved_at=time.time()), args.runs)

        def both() -> None:
            safetensors.torch.save(lora, metadata=file_metadata(lora, training, title="bench", saved_at=time.time()))

        total = median_time(both, args.runs)
        print(f"{label:<26} {plain * 1e3:>8.0f} ms {meta * 1e3:>7.0f} ms {total * 1e3:>6.0f} ms "
              f"{total / plain:>12.2f}×")


if __name__ == "__main__":
    main()
