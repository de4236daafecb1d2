"""The Train LoRA options the short runs of the feature tests share (``tests/comfy/test_train_dropout.py``,
``test_optimizer_args.py``, ``test_input_perturbation.py``, ``test_adafactor.py``, ``test_adamw8bit.py``): fp32 (bf16
convolutions are emulated on CPUs without AVX512-BF16), batch 2, rank 4, no checkpointing, every later input at its
default; and the Save LoRA Weights step between a run and its continuation (:func:`save_lora`)."""

from __future__ import annotations

from typing import Any

import torch

SHORT_RUN: dict[str, Any] = {
    "batch_size": 2, "grad_accumulation_steps": 1, "steps": 3, "learning_rate": 3e-3, "rank": 4,
    "optimizer": "AdamW", "loss_function": "MSE", "seed": 7, "training_dtype": "fp32", "lora_dtype": "fp32",
    "algorithm": "LoRA", "gradient_checkpointing": False, "checkpoint_depth": 1, "offloading": False,
    "existing_lora": "[None]", "prefetch_batches": 2, "loader_threads": 0, "quantized_backward": False,
    "bypass_mode": False, "devices": "auto",
}


def train(node: type, model: Any, dataset: Any, base: dict[str, Any] | None = None, **options: Any) -> Any:
    """Train LoRA's ``execute`` under inference mode, as ComfyUI runs a node, with :data:`SHORT_RUN` (or ``base``)
    and ``options``."""
    with torch.inference_mode():
        return node.execute(model, dataset, **{**(SHORT_RUN if base is None else base), **options})


def summary(out: Any) -> str:
    """The node's text output (its summary)."""
    (text,) = out.ui["text"] if isinstance(out.ui, dict) else out.ui.as_dict()["text"]
    return text


def save_lora(lora: dict[str, torch.Tensor], steps: int | None, prefix: str) -> str:
    """Save ``lora`` with ComfyUI's own Save LoRA Weights node, as a user does between two runs; return the one new
    name ComfyUI's LoRA list shows (what ``existing_lora`` takes)."""
    import folder_paths
    from comfy_extras.nodes_train import SaveLoRA

    before = set(folder_paths.get_filename_list("loras"))
    SaveLoRA.execute(lora, prefix, steps)
    (name,) = set(folder_paths.get_filename_list("loras")) - before
    return str(name)
