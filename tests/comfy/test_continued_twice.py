"""The optimizers whose state this pack keeps its own way (AdamW8bit and Lion8bit: uint8 code indices; Adafactor: fp32
moments of a bf16 LoRA; Prodigy: its step size in the parameter group), through Train LoRA on the real ComfyUI (CPU,
tiny SD1.5): a bf16 run continued twice from its training state trains what one uninterrupted run trains, bit for
bit. The second continuation reads the state the first one wrote: torch's ``load_state_dict`` had turned the 8-bit
optimizers' code indices into numbers of the LoRA's dtype, so that state was refused and the third run started a
fresh optimizer. (AdamW, Adam, RMSprop and Lion, whose state has the LoRA's dtype as torch loads it, pass this too:
checked once on 1f8b745, not kept.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.train_options import SHORT_RUN, save_lora, summary, train

EIGHT_BIT = "min_8bit_size=128"
"""The tiny model's LoRA tensors hold 128 to 1,280 weights: the threshold lowered so they keep 8-bit moments."""


@pytest.mark.parametrize(("optimizer", "rate"), [("AdamW8bit", 1e-3), ("Lion8bit", 1e-4), ("Adafactor", 1e-3),
                                                 ("Prodigy", 1.0)])
def test_a_run_continued_twice_trains_what_one_run_trains(train_node: type, models: tuple, six_images: Any,
                                                         lora_folder: Path, optimizer: str, rate: float) -> None:
    base = {**SHORT_RUN, "optimizer": optimizer, "learning_rate": rate,
            "optimizer_args": EIGHT_BIT if optimizer.endswith("8bit") else "", "lora_dtype": "bf16"}
    whole = train(train_node, models[0], six_images, base, steps=9).result
    run = train(train_node, models[0], six_images, base)
    losses = run.result[1]["loss"]
    for part in (1, 2):
        name = save_lora(run.result[0], run.result[2], f"loras/{optimizer.lower()}_{part}")
        run = train(train_node, models[0], six_images, base, existing_lora=name)
        assert f"{optimizer} state restored" in summary(run) and "NOTE" not in summary(run), summary(run)
        losses = losses + run.result[1]["loss"]
    assert losses == whole[1]["loss"]
    assert all(torch.equal(run.result[0][k], whole[0][k]) for k in whole[0])
