"""Benchmark: what a ``train_layers`` choice trains, per full-size family: the layers with adapters, the LoRA's
parameters and file size, and the AdamW state the run keeps on the device.

Counted, not timed: each family's diffusion model is made on ``meta`` from ComfyUI's own class (no weights, no
download, seconds for all of them), and every chosen layer gets the adapter ComfyUI's trainer would make, by
ComfyUI's own ``create_train`` on a ``meta`` stand-in of its weight (1-D weights and biases a diff of their size,
as ``_create_weight_adapter`` and ``_create_bias_adapter`` make them). The counts are exact and the same on any
machine; what a choice saves in step time on a GPU is ``scripts/bench-gpu``'s ``options/<family>-layers`` arm.

    scripts/bench-comfy layers             # the Markdown table of docs/BENCHMARKS.md's train_layers section
    scripts/bench-comfy layers --check     # exit 1 when the doc's table is not what this prints

Run through ``bench/run_comfyui.py`` (what ``scripts/bench-comfy`` does).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CHOICES", "RANK", "LayerFigures", "count", "render", "main"]

RANK = 16
CHOICES: dict[str, tuple[str, ...]] = {
    "sd15": ("", "attn", "attn2", "-norm"),
    "sdxl": ("", "attn", "attn2", "-norm"),
    "flux": ("", "double_blocks", "single_blocks", "img_attn, txt_attn"),
    "wan21": ("", "self_attn", "cross_attn"),
    "qwen_image": ("", "attn", "-norm"),
    "lumina2": ("", "attention", "-norm"),
}
"""Each family's choices in the table: every layer (``""``, ComfyUI's own trainer), then pieces of its layer names
that choose a part users train (attention, cross-attention, one kind of block), and all but the norms."""
_BYTES_BF16 = 2
_ADAMW_SLOTS = 2
"""AdamW's moments per parameter, in the parameter's dtype (torch's AdamW on a bf16 LoRA)."""


@dataclass(frozen=True)
class LayerFigures:
    """One family and choice: layers chosen (of all), adapter tensors, parameters."""

    family: str
    choice: str
    layers: int
    total: int
    tensors: int
    params: int

    @property
    def lora_mib(self) -> float:
        return self.params * _BYTES_BF16 / 2**20

    @property
    def adamw_mib(self) -> float:
        return self.params * _BYTES_BF16 * _ADAMW_SLOTS / 2**20


def _adapter_params(module: Any, make: Any, made: dict[tuple[int, ...], list[int]]) -> list[int]:
    """The sizes of the parameters ComfyUI's trainer gives ``module``: a LoRA for a matrix or kernel (``make``'s
    ``create_train`` on an uninitialised stand-in of the weight's shape; ``made`` remembers each shape's), a diff
    for a 1-D weight, and a diff for a bias."""
    import torch

    sizes: list[int] = []
    weight = getattr(module, "weight", None)
    if weight is not None:
        if weight.ndim >= 2:
            shape = tuple(weight.shape)
            if shape not in made:  # create_train copies into its parameters: a CPU stand-in, not meta
                adapter = make.create_train(torch.empty(shape, dtype=torch.bfloat16), rank=RANK, alpha=1.0)
                made[shape] = [p.numel() for p in adapter.parameters()]
            sizes += made[shape]
        else:
            sizes.append(weight.numel())
    if getattr(module, "bias", None) is not None:
        sizes.append(module.bias.numel())
    return sizes


def count(family: str, choices: Sequence[str]) -> list[LayerFigures]:
    """Each of ``choices`` on ``family``'s full-size model (made on ``meta``), chosen by Train LoRA's own
    ``choose_layers`` (the pack imported as ComfyUI imports it), so the table counts what a run trains."""
    import importlib

    import torch

    import comfy.model_detection
    from comfy.weight_adapter import adapter_maps
    from support.pack import import_pack

    from .gpu_models import FULL_FAMILIES

    pack = import_pack().__name__
    layers = importlib.import_module(f"{pack}.nodes.training.layers")
    layer_filter = importlib.import_module(f"{pack}.dataset_cache.layer_filter")
    config = comfy.model_detection.model_config_from_unet_config(dict(FULL_FAMILIES[family].unet_config))
    model = config.get_model({}, device=torch.device("meta"))
    modules = dict(model.named_modules())
    made: dict[tuple[int, ...], list[int]] = {}
    sizes = {name: _adapter_params(modules[name], adapter_maps["LoRA"], made) for name in layers.adapter_layers(model)}
    out = []
    for choice in choices:
        chosen = layers.choose_layers(model, layer_filter.LayerFilter.parse(choice), {}, "[None]").chosen
        out.append(LayerFigures(family, choice, len(chosen), len(sizes), sum(len(sizes[n]) for n in chosen),
                                sum(sum(sizes[n]) for n in chosen)))
    return out


def render(figs: Sequence[LayerFigures]) -> list[str]:
    """The Markdown table, a row per family and choice (each family's share against its every-layer row)."""
    from .gpu_models import FULL_FAMILIES

    lines = ["| family | `train_layers` | layers | adapter tensors | parameters | LoRA (bf16) | AdamW state "
             "| share |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    every: dict[str, LayerFigures] = {}
    for f in figs:
        every.setdefault(f.family, f) if f.choice == "" else None
        base = every.get(f.family)
        share = f"{f.params / base.params:.1%}" if base is not None and base.params else "—"
        lines.append(f"| {FULL_FAMILIES[f.family].title} | {f'`{f.choice}`' if f.choice else '(every layer)'} "
                     f"| {f.layers:,} of {f.total:,} | {f.tensors:,} | {f.params / 1e6:.1f} M | {f.lora_mib:.1f} MiB "
                     f"| {f.adamw_mib:.1f} MiB | {share} |")
    return lines


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="scripts/bench-comfy layers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated families (default: every family of CHOICES)")
    ap.add_argument("--check", type=Path, nargs="?", const=Path("docs/BENCHMARKS.md"), default=None,
                    help="compare with the table in this doc (default docs/BENCHMARKS.md) instead of printing")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    families = [f.strip() for f in args.only.split(",") if f.strip()] or list(CHOICES)
    unknown = sorted(set(families) - set(CHOICES))
    if unknown:
        raise SystemExit(f"--only: unknown families {unknown}; known: {sorted(CHOICES)}")
    from .comfyui import comfy_setup

    with tempfile.TemporaryDirectory(prefix="bench-layers-") as tmp:
        comfy_setup(Path(tmp))
        lines = render([f for family in families for f in count(family, CHOICES[family])])
    if args.check is None:
        print("\n".join(lines))
        return 0
    doc = args.check.read_text(encoding="utf-8")
    missing = [line for line in lines if line not in doc.splitlines()]
    for line in missing:
        print(f"not in {args.check}: {line}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
