"""Node "Save LoRA (Stream Cache)": writes a LoRA as ComfyUI's *Save LoRA Weights* does, with its training metadata.

ComfyUI's node writes the tensors alone. A LoRA from Train LoRA (Stream Cache) carries what kohya's trainers write
into theirs (``ss_*`` training keys, the model spec's ``modelspec.*``, content hashes; see
:mod:`dataset_cache.lora_metadata`), which Civitai and the LoRA browsers read; this node writes it. A LoRA from
elsewhere is written with its name and content hashes only. The file name is Save LoRA Weights' (``existing_lora``
reads the step count from it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from comfy_api.latest import io, ui

from .training.settings import DEFAULT_SAVE_PREFIX, check_save_prefix
from .training.lora_output import TrainedLora, write_lora
from .training.saves import shown_path
from .ui_output import show_text

__all__ = ["SaveLoRA"]

log = logging.getLogger("streamcache.train")

MAX_STEPS = 10_000_000


def _steps_of(lora: Mapping[str, Any], steps: int) -> int | None:
    """The step count the file is named with: ``steps`` when set, else the LoRA's own (Train LoRA's says it)."""
    if steps > 0:
        return steps
    own = lora.metadata.get("ss_steps", "") if isinstance(lora, TrainedLora) else ""
    return int(own) if own.isdigit() else None


def _check_lora(lora: Any) -> dict[str, torch.Tensor]:
    """The LoRA's tensors, or a ValueError naming ``lora`` and what it got."""
    if not isinstance(lora, Mapping) or not lora:
        raise ValueError(f"lora: expected a LORA_MODEL (Train LoRA's lora output), got {type(lora).__name__}"
                         f"{' (empty)' if isinstance(lora, Mapping) else ''}")
    bad = next((k for k, v in lora.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)), None)
    if bad is not None:
        raise ValueError(f"lora: entry {bad!r:.80} is not a named tensor; connect a LORA_MODEL")
    return dict(lora)


class SaveLoRA(io.ComfyNode):
    """Writes a LORA_MODEL to ComfyUI's output folder with the metadata of its training."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="StreamCache_SaveLoRA",
            display_name="Save LoRA (Stream Cache)",
            category="StreamCache",
            description="Saves a LoRA as Save LoRA Weights does, with what it was trained on and how (kohya's "
                        "ss_* keys, model spec, hashes) as the file's metadata, which Civitai and LoRA browsers "
                        "show.",
            is_output_node=True,
            inputs=[
                io.Custom("LORA_MODEL").Input("lora", tooltip="The LoRA to save: Train LoRA (Stream Cache)'s lora "
                                              "output (with its training metadata) or any LORA_MODEL."),
                io.String.Input("save_prefix", default=DEFAULT_SAVE_PREFIX,
                                tooltip="Where in ComfyUI's output folder and under which name: "
                                "<save_prefix>_<steps>_steps_<counter>_.safetensors, as Save LoRA Weights and "
                                "Train LoRA's save_every name their files."),
                io.Int.Input("steps", default=0, min=0, max=MAX_STEPS, optional=True,
                             tooltip="The step count in the file name (connect Train LoRA's steps). 0: the LoRA's "
                             "own (Train LoRA (Stream Cache)'s LoRA knows it), else none in the name."),
            ],
            outputs=[],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, lora: Any, save_prefix: str = DEFAULT_SAVE_PREFIX, steps: int | None = 0) -> io.NodeOutput:
        tensors = _check_lora(lora)
        check_save_prefix(save_prefix)
        if steps is not None and (type(steps) is not int or not 0 <= steps <= MAX_STEPS):
            raise ValueError(f"steps must be a whole number from 0 to {MAX_STEPS}, got {steps!r:.20}")
        metadata = lora.metadata if isinstance(lora, TrainedLora) else {}
        path = write_lora(tensors, save_prefix, _steps_of(lora, steps or 0), metadata)
        where = shown_path(path)
        log.info("Save LoRA (Stream Cache): saved %s (%s)", where,
                 "with its training metadata" if metadata else "no training metadata: not trained by this pack")
        text = f"saved {where}" + ("" if metadata else " (no training metadata: not trained by this pack)")
        show_text(text, getattr(getattr(cls, "hidden", None), "unique_id", None))
        return io.NodeOutput(ui=ui.PreviewText(text))
