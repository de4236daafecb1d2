"""``scripts/bench-comfy layers`` (``bench/train_layers.py``) on the real ComfyUI: its counts are ComfyUI's own
adapters' (checked against the adapters Train LoRA makes on the tiny SD1.5), and docs/BENCHMARKS.md's table is what
it prints (counts, not timings: the same on every machine)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from support.pack import import_bench

import_bench()

from bench import train_layers  # noqa: E402

PACK_ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_table_is_what_the_command_prints(comfy_folders: Path) -> None:
    lines = train_layers.render([f for family, choices in train_layers.CHOICES.items()
                                 for f in train_layers.count(family, choices)])
    doc = (PACK_ROOT / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()
    start = doc.index(lines[0])
    assert doc[start:start + len(lines)] == lines


def test_every_choice_chooses_layers_and_less_than_every_layer(comfy_folders: Path) -> None:
    for family, choices in train_layers.CHOICES.items():
        every, *parts = train_layers.count(family, choices)
        assert every.layers == every.total > 0 and every.tensors >= every.layers
        for f in parts:
            assert 0 < f.layers < every.total and 0 < f.params < every.params, (family, f.choice)


def test_the_counts_are_those_of_the_adapters_train_lora_makes(pack: ModuleType, models: tuple,
                                                              tmp_path: Path) -> None:
    """The bench's rule (a LoRA per matrix or kernel, a diff per 1-D weight and per bias) on the tiny SD1.5 model
    gives the tensors and parameters of the adapters ComfyUI's setup makes there (at the bench's rank)."""
    comfy_parts = importlib.import_module(f"{pack.__name__}.nodes.training.comfy_parts")
    layers_mod = importlib.import_module(f"{pack.__name__}.nodes.training.layers")
    layer_filter = importlib.import_module(f"{pack.__name__}.dataset_cache.layer_filter")
    from comfy.weight_adapter import adapter_maps

    mp = models[0].clone()
    made: dict[tuple[int, ...], list[int]] = {}
    for choice in ("", "attn2"):
        choose = layers_mod.choose_layers(mp.model, layer_filter.LayerFilter.parse(choice), {}, "[None]")
        expected = [s for name, m in mp.model.named_modules() if name in choose.chosen
                    for s in train_layers._adapter_params(m, adapter_maps["LoRA"], made)]
        view: Any = choose.view(mp.clone())
        lora_sd, _adapters = comfy_parts.nodes_train_module()._setup_lora_adapters(
            view, {}, "LoRA", torch.float32, train_layers.RANK)
        assert len(lora_sd) == len(expected) and sum(p.numel() for p in lora_sd.values()) == sum(expected)


_FAMILY_ROWS = {"SD1.5, SDXL": ("sd15", "sdxl"), "Flux": ("flux",), "WAN 2.1 / 2.2": ("wan21",),
                "Qwen-Image": ("qwen_image",), "Lumina 2": ("lumina2",)}


def test_the_help_pages_layer_pieces_choose_part_of_each_familys_layers(comfy_folders: Path) -> None:
    """Train LoRA's help page lists pieces of layer names per family: each chooses some of that family's full-size
    layers, not all (a renamed layer in a ComfyUI update fails here, not in a user's run)."""
    page = (PACK_ROOT / "web" / "docs" / "StreamCache_TrainLoRA.md").read_text(encoding="utf-8")
    section = page.split("## Layer names, for `train_layers`", 1)[1].split("\n## ", 1)[0]
    rows = {cells[0].strip(): re.findall(r"`([^`]+)`", cells[1])
            for cells in (line.strip("|").split("|") for line in section.splitlines() if line.startswith("| "))
            if cells[0].strip() in _FAMILY_ROWS}
    assert set(rows) == set(_FAMILY_ROWS)
    for title, families in _FAMILY_ROWS.items():
        for family in families:
            every, *chosen = train_layers.count(family, ("", *rows[title]))
            for piece, fig in zip(rows[title], chosen):
                assert 0 < fig.layers < every.total, (family, piece, fig.layers)
